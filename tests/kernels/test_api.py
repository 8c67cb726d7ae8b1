"""Public API of toolkit.kernels: dispatch, input errors, open_clip parity, naive exports."""

from __future__ import annotations

import pytest
import torch
from kernel_oracles import check_clip_loss, check_lse_case, clip_floors, rel_err, unit_rows

from toolkit import kernels as K


def test_auto_is_torch_on_cpu():
    assert K.resolve_backend("auto", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="unknown kernels backend 'fast'"):
        K.resolve_backend("fast", torch.device("cpu"))


def test_naive_exports_still_importable():
    from toolkit.kernels import naive_clip_loss, naive_lse_backward, naive_lse_forward  # noqa: F401


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda x, y, a: K.lse_forward(x, y[:, :3], a, a), "same feature dim"),
        (lambda x, y, a: K.lse_forward(x[0], y, a, a), "must be 2-d"),
        (lambda x, y, a: K.lse_forward(x, y, torch.ones(2), a), r"row_scale must be 0-d or \[5\]"),
        (lambda x, y, a: K.lse_forward(x, y, a, torch.ones(5)), r"col_scale must be 0-d or \[6\]"),
        (
            lambda x, y, a: K.lse_backward(x, y, a, a, None, None, torch.ones(5), None),
            "grad_row given without",
        ),
        (lambda x, y, a: K.clip_loss(x, y[:5], torch.ones(1)), "logit_scale must be 0-d"),
        (lambda x, y, a: K.clip_loss(x, y, a), "same shape"),
    ],
)
def test_bad_input_errors(bad, match, gen):
    x, y = unit_rows(5, 4, gen), unit_rows(6, 4, gen)
    with pytest.raises(ValueError, match=match):
        bad(x, y, torch.tensor(1.0))


@pytest.mark.parametrize("b,d,value", [(1, 72, 1.0), (3, 96, 100.0), (41, 72, 100.0)])
def test_clip_loss_matches_open_clip(b, d, value, gen):
    from open_clip.loss import ClipLoss

    x, y = unit_rows(b, d, gen), unit_rows(b, d, gen)
    out = []
    for fn in (lambda i, t, a: ClipLoss()(i, t, a), lambda i, t, a: K.clip_loss(i, t, a, backend="torch")):
        xi, yi, a = (
            x.clone().requires_grad_(),
            y.clone().requires_grad_(),
            torch.tensor(value, requires_grad=True),
        )
        loss = fn(xi, yi, a)
        loss.backward()
        out.append((loss, xi.grad, yi.grad, a.grad))
    names = ("loss", "d_image", "d_text", "d_logit_scale")
    for name, o, r, floor in zip(names, out[1], out[0], clip_floors(b, value), strict=True):
        err = rel_err(o, r, floor)
        assert err <= 1e-5, f"{name} rel err {err:.2e}"


def test_naive_backend_fp32_matches_float64(gen, poisoned):
    """The naive backend is also a backend: fp32 through the dispatcher vs its own float64 run."""
    check_lse_case("naive", 29, 41, 96, -3, "per_row", "per_row", 100.0, None, torch.float32, 1e-5, gen)
    check_clip_loss("naive", 17, 72, 100.0, None, torch.float32, 1e-5, gen)


@pytest.mark.parametrize("backend", ["naive", "torch", "triton"])
def test_backward_skips_a_side_on_request(backend, gen, poisoned):
    """compute_dx/compute_dy=False return None for that side (dx and d_row_scale / dy and d_col_scale) and
    leave the other side exactly as the full call computes it."""
    if backend == "triton":
        pytest.importorskip("triton")
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    m, n, d = 19, 37, 72
    x, y = unit_rows(m, d, gen).to(dev), unit_rows(n, d, gen).to(dev)
    rs, cs = (10 + 5 * torch.rand(m, generator=gen)).to(dev), torch.tensor(12.0, device=dev)
    row, col = K.lse_forward(x, y, rs, cs, 3, backend=backend, block_size=16)
    g_r, g_c = torch.randn(m, generator=gen).to(dev), torch.randn(n, generator=gen).to(dev)
    args = (x, y, rs, cs, row, col, g_r, g_c, 3)
    full = K.lse_backward(*args, backend=backend, block_size=16)
    x_side = K.lse_backward(*args, backend=backend, block_size=16, compute_dy=False)
    y_side = K.lse_backward(*args, backend=backend, block_size=16, compute_dx=False)
    assert x_side[1] is None and x_side[3] is None and y_side[0] is None and y_side[2] is None
    for got, want in ((x_side[0], full[0]), (x_side[2], full[2]), (y_side[1], full[1]), (y_side[3], full[3])):
        assert torch.equal(got, want)
    assert K.lse_backward(*args, backend=backend, compute_dx=False, compute_dy=False) == (
        None,
        None,
        None,
        None,
    )


def test_auto_backend_keeps_ieee_fp32_off_triton_on_cuda():
    """auto: Triton for half-precision CUDA features and for fp32 with TF32 allowed; the chunked torch
    backend for IEEE fp32 (Triton's fp32 dot was ~23x slower on an H100) and on the CPU."""
    from toolkit.kernels import resolve_backend, triton_available

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve_backend("auto", cpu, torch.bfloat16) == "torch"
    if not triton_available():
        pytest.skip("triton does not import here")
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert resolve_backend("auto", cuda, torch.bfloat16) == "triton"
        assert resolve_backend("auto", cuda, torch.float16) == "triton"
        assert resolve_backend("auto", cuda, torch.float32) == "torch"
        assert resolve_backend("auto", cuda) == "triton"  # dtype unknown: as before
        torch.set_float32_matmul_precision("high")  # TF32 dots
        assert resolve_backend("auto", cuda, torch.float32) == "triton"
        assert resolve_backend("triton", cuda, torch.float32) == "triton"  # asked for explicitly
    finally:
        torch.set_float32_matmul_precision(before)
