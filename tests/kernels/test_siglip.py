"""The sigmoid (SigLIP) loss kernels against open_clip's ``SigLipLoss`` (float64) and the float64 naive
reference: values and gradients of x, y, t and b, odd sizes, batch 1, uneven strips, offsets of the
distributed blocks, large |t·s + b|, low-precision inputs; the Triton kernel under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from kernel_oracles import rel_err, unit_rows
from open_clip.loss import SigLipLoss

from toolkit import kernels as K

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _loss_and_grads(fn, x, y, t, b):
    leaves = [v.clone().requires_grad_() for v in (x, y, t, b)]
    loss = fn(*leaves)
    return [loss.detach(), *torch.autograd.grad(loss, leaves)]


def _inputs(b: int, d: int, gen, t: float = 10.0, bias: float = -10.0):
    x, y = unit_rows(b, d, gen, torch.float64), unit_rows(b, d, gen, torch.float64)
    jitter = torch.rand(2, generator=gen, dtype=torch.float64)  # off the round init values
    return (
        x,
        y,
        torch.tensor(t, dtype=torch.float64) + jitter[0],
        torch.tensor(bias, dtype=torch.float64) + jitter[1],
    )


@pytest.mark.parametrize("backend,block", [("naive", None), ("torch", None), ("torch", 3), ("torch", 16)])
@pytest.mark.parametrize("b,d", [(1, 5), (2, 3), (37, 24), (101, 64)])
def test_float64_parity_with_open_clip(backend, block, b, d, gen):
    x, y, t, bias = _inputs(b, d, gen)
    want = _loss_and_grads(SigLipLoss(), x, y, t, bias)
    got = _loss_and_grads(lambda *a: K.siglip_loss(*a, backend=backend, block_size=block), x, y, t, bias)
    for name, g, w in zip(("loss", "dx", "dy", "dt", "db"), got, want, strict=True):
        assert g.dtype == torch.float64, name
        assert rel_err(g, w) <= 1e-9, (name, rel_err(g, w))


@pytest.mark.parametrize("t,bias", [(100.0, 50.0), (100.0, -50.0), (1e3, 0.0)])
def test_large_logits_stay_exact(t, bias, gen):
    """|t·s + b| up to ~1000: softplus terms, never log σ of an underflowed sigmoid; fp32 too."""
    x, y, tt, bb = _inputs(45, 16, gen, t, bias)
    x[:5] = y[:5]  # positives at s = 1: the largest |u|
    want = _loss_and_grads(SigLipLoss(), x, y, tt, bb)
    got = _loss_and_grads(lambda *a: K.siglip_loss(*a, backend="torch", block_size=8), x, y, tt, bb)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all() and rel_err(g, w) <= 1e-9
    got32 = _loss_and_grads(
        lambda *a: K.siglip_loss(*a, backend="torch"), x.float(), y.float(), tt.float(), bb.float()
    )
    for g, w in zip(got32, want, strict=True):
        assert g.dtype == torch.float32 and torch.isfinite(g).all() and rel_err(g, w) <= 1e-4


@pytest.mark.parametrize("m,n,offset", [(23, 70, 7), (50, 23, -5), (9, 9, None), (1, 12, 11), (12, 1, -11)])
def test_block_sums_with_offsets_match_the_reference(m, n, offset, gen):
    """The distributed blocks: rectangular, positives on a shifted diagonal, or none at all."""
    x, y = unit_rows(m, 16, gen, torch.float64), unit_rows(n, 16, gen, torch.float64)
    t, b = torch.tensor(7.3, dtype=torch.float64), torch.tensor(-4.1, dtype=torch.float64)
    want = K.sigmoid_sums(x, y, t, b, offset, compute_dx=True, compute_dy=True, backend="naive")
    for dx, dy in ((True, True), (True, False), (False, True)):
        got = K.sigmoid_sums(x, y, t, b, offset, compute_dx=dx, compute_dy=dy, backend="torch", block_size=4)
        assert (got.dx is None) != dx and (got.dy is None) != dy
        for g, w in zip(got, want, strict=True):
            assert g is None or rel_err(g, w) <= 1e-12
    only_grads = K.sigmoid_sums(x, y, t, b, offset, compute_dx=True, compute_loss=False, backend="torch")
    assert only_grads.loss == 0 and rel_err(only_grads.dx, want.dx) <= 1e-12
    value = K.sigmoid_sums(x, y, t, b, offset, backend="torch")
    assert value.dx is value.dy is value.d_scale is None and rel_err(value.loss, want.loss) <= 1e-12


def test_gradient_subsets_no_grad_and_no_bias(gen):
    x, y, t, b = _inputs(11, 8, gen)
    full = _loss_and_grads(lambda *a: K.siglip_loss(*a, backend="torch"), x, y, t, b)
    tt = t.clone().requires_grad_()  # only the scale learns: the x side's sweep gives its gradient
    (dt,) = torch.autograd.grad(K.siglip_loss(x, y, tt, b, backend="torch"), tt)
    assert rel_err(dt, full[3]) <= 1e-12
    with torch.no_grad():
        assert rel_err(K.siglip_loss(x, y, t, b, backend="torch"), full[0]) <= 1e-12
    assert (
        rel_err(K.siglip_loss(x, y, t, None), K.siglip_loss(x, y, t, torch.zeros((), dtype=torch.float64)))
        == 0
    )
    assert rel_err(K.siglip_loss(x, y, t, None), SigLipLoss()(x, y, t, None)) <= 1e-12


def test_low_precision_inputs(gen):
    x, y, t, b = _inputs(40, 32, gen)
    want = _loss_and_grads(SigLipLoss(), x, y, t, b)
    for dtype in (torch.bfloat16, torch.float16):
        xs, ys = x.to(dtype), y.to(dtype)
        want = _loss_and_grads(SigLipLoss(), xs.double(), ys.double(), t, b)  # same rounded inputs
        got = _loss_and_grads(lambda *a: K.siglip_loss(*a, backend="torch"), xs, ys, t.float(), b.float())
        assert got[1].dtype == dtype and got[0].dtype == torch.float32
        for g, w in zip(got, want, strict=True):
            assert rel_err(g, w) <= 2e-2


def test_bad_inputs_are_refused(gen):
    x = unit_rows(4, 8, gen)
    with pytest.raises(ValueError, match="same shape"):
        K.siglip_loss(x, x[:3], 10.0, -10.0)
    with pytest.raises(ValueError, match="scale must be 0-d"):
        K.siglip_loss(x, x, torch.ones(2), -10.0)
    with pytest.raises(ValueError, match="unknown kernels backend"):
        K.siglip_loss(x, x, 10.0, -10.0, backend="cuda")


# Triton: tiny sizes (the interpreter is slow); B % block != 0, batch 1, rectangular blocks with offsets.
@pytest.mark.parametrize("b,d,block", [(1, 72, 16), (37, 40, 16), (70, 96, 32)])
def test_triton_matches_open_clip(b, d, block, gen, poisoned):
    pytest.importorskip("triton")
    x, y, t, bias = _inputs(b, d, gen)
    want = _loss_and_grads(SigLipLoss(), x.float().double(), y.float().double(), t, bias)
    args = [v.float().to(DEVICE) for v in (x, y, t, bias)]
    got = _loss_and_grads(lambda *a: K.siglip_loss(*a, backend="triton", block_size=block), *args)
    for name, g, w in zip(("loss", "dx", "dy", "dt", "db"), got, want, strict=True):
        assert g.dtype == torch.float32 and rel_err(g, w) <= 1e-5, (name, rel_err(g, w))


@pytest.mark.parametrize("m,n,offset", [(23, 50, 7), (40, 17, -5), (20, 20, None)])
def test_triton_block_sums(m, n, offset, gen, poisoned):
    pytest.importorskip("triton")
    x, y = unit_rows(m, 24, gen), unit_rows(n, 24, gen)
    t, b = torch.tensor(12.5), torch.tensor(-9.0)
    want = K.sigmoid_sums(
        x.double(),
        y.double(),
        t.double(),
        b.double(),
        offset,
        compute_dx=True,
        compute_dy=True,
        backend="naive",
    )
    dev = [v.to(DEVICE) for v in (x, y, t, b)]
    for dx, dy in ((True, True), (False, True)):
        got = K.sigmoid_sums(*dev, offset, compute_dx=dx, compute_dy=dy, backend="triton", block_size=16)
        for g, w in zip(got, want, strict=True):
            assert g is None or rel_err(g, w) <= 1e-5


def test_triton_bf16(gen, poisoned):
    pytest.importorskip("triton")
    x, y, t, b = _inputs(33, 40, gen)
    xs, ys = x.to(torch.bfloat16), y.to(torch.bfloat16)
    want = _loss_and_grads(SigLipLoss(), xs.double(), ys.double(), t, b)
    args = [v.to(DEVICE) for v in (xs, ys, t.float(), b.float())]
    got = _loss_and_grads(lambda *a: K.siglip_loss(*a, backend="triton", block_size=16), *args)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) <= 2e-2
