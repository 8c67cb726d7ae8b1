"""Chunked PyTorch backend vs the float64 naive oracle: values, gradients, gradcheck, odd shapes."""

from __future__ import annotations

import pytest
import torch
from kernel_oracles import check_clip_loss, check_lse_case, rel_err, unit_rows

from toolkit import kernels as K

# (M, N, D, diag_offset, row scale kind, col scale kind, scale value, block_size)
LSE_CASES = [
    (1, 1, 72, None, "scalar", "scalar", 1.0, None),  # batch 1
    (3, 3, 96, 0, "scalar", "scalar", 100.0, 2),  # B=3, strips of 2 (uneven last strip)
    (37, 37, 72, 0, "per_row", "per_row", 100.0, 8),  # individual temperatures, B % block != 0
    (50, 23, 96, -5, "per_row", "scalar", 30.0, 16),  # rectangular, negative offset
    (23, 50, 72, 7, "scalar", "per_row", 1.0, None),  # rectangular, ring-style offset
    (40, 40, 96, 45, "scalar", "scalar", 100.0, 7),  # offset past the end: nothing masked
]


@pytest.mark.parametrize("case", LSE_CASES, ids=lambda c: "M{}N{}D{}k{}_{}_{}_a{}_bs{}".format(*c))
def test_lse_matches_float64_oracle(case, gen, poisoned):
    check_lse_case("torch", *case, dtype=torch.float32, tol=1e-5, gen=gen)


def test_lse_bf16_inputs(gen, poisoned):
    check_lse_case("torch", 33, 29, 72, 2, "per_row", "scalar", 100.0, 8, torch.bfloat16, 2e-2, gen)


def test_fully_masked_row_is_neg_inf(gen):
    x, y = unit_rows(1, 8, gen), unit_rows(1, 8, gen)
    row, col = K.lse_forward(x, y, torch.tensor(2.0), torch.tensor(2.0), 0, backend="torch")
    assert row.item() == float("-inf") and col.item() == float("-inf")


def test_one_sided_upstream_and_compute_flags(gen, poisoned):
    m, n, d = 19, 26, 72
    x, y = unit_rows(m, d, gen).double(), unit_rows(n, d, gen).double()
    a = torch.tensor(50.0, dtype=torch.float64)
    row, col = K.lse_forward(x.float(), y.float(), a, a, 3, compute_row=False, backend="torch", block_size=4)
    assert row is None and rel_err(col, K.lse_forward(x, y, a, a, 3, backend="naive")[1]) <= 1e-5
    ref_row, _ = K.lse_forward(x, y, a, a, 3, backend="naive")
    g = torch.randn(m, generator=gen, dtype=torch.float64)
    ref = K.lse_backward(x, y, a, a, ref_row, None, g, None, 3, backend="naive")
    out = K.lse_backward(x.float(), y.float(), a, a, ref_row, None, g, None, 3, backend="torch", block_size=4)
    for o, r in zip(out, ref, strict=True):
        assert rel_err(o, r) <= 1e-5
    assert torch.count_nonzero(out[3]) == 0  # no column upstream: no column-scale gradient


def test_arbitrary_normalisers_in_backward(gen):
    """FastCLIP passes log-estimators, not the true LSEs: the backward must just use them."""
    m, d = 21, 72
    x, y = unit_rows(m, d, gen).double(), unit_rows(m, d, gen).double()
    a = torch.tensor(14.0, dtype=torch.float64)
    norm_r, norm_c = (
        torch.randn(m, generator=gen, dtype=torch.float64),
        torch.randn(m, generator=gen, dtype=torch.float64),
    )
    g_r, g_c = (
        torch.rand(m, generator=gen, dtype=torch.float64),
        torch.rand(m, generator=gen, dtype=torch.float64),
    )
    ref = K.lse_backward(x, y, a, a, norm_r, norm_c, g_r, g_c, 0, backend="naive")
    out = K.lse_backward(
        x.float(), y.float(), a, a, norm_r, norm_c, g_r, g_c, 0, backend="torch", block_size=5
    )
    for o, r in zip(out, ref, strict=True):
        assert rel_err(o, r) <= 1e-5


@pytest.mark.parametrize(
    "b,d,value,block", [(1, 72, 1.0, None), (3, 96, 100.0, 2), (37, 72, 100.0, 8), (64, 96, 1.0, 16)]
)
def test_clip_loss_matches_oracle(b, d, value, block, gen, poisoned):
    check_clip_loss("torch", b, d, value, block, torch.float32, 1e-5, gen)


def test_gradcheck_tiled_lse(gen):
    m, n, d = 5, 4, 3
    x = torch.randn(m, d, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randn(n, d, generator=gen, dtype=torch.float64, requires_grad=True)
    rs = (torch.rand(m, generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
    cs = torch.tensor(1.7, dtype=torch.float64, requires_grad=True)

    def f(x, y, rs, cs):
        row, col = K.tiled_lse(x, y, rs, cs, -1, backend="torch", block_size=2)
        return row, col

    assert torch.autograd.gradcheck(f, (x, y, rs, cs))


def test_gradcheck_clip_loss(gen):
    x = torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    y = torch.randn(4, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    a = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, y, a: K.clip_loss(x, y, a, backend="torch", block_size=3), (x, y, a)
    )


@pytest.mark.parametrize("diag_offset", [None, 1])
def test_shared_scale_underflow_lines_are_recomputed(diag_offset, gen):
    """One shared scale: the forward shifts a strip by its max and takes one exp; a row (x ⟂ everything)
    or column (y anti-aligned with the strip) whose own max lies ~100 below would underflow to
    log 0 = -inf without the exact recomputation."""
    d = 16
    e = torch.eye(d, dtype=torch.float64)
    noise = 1e-3 * torch.randn(6, d, generator=gen, dtype=torch.float64)
    x = torch.stack([e[0], e[1], e[0], e[2]]) + noise[:4]
    y = torch.stack([e[0], -e[0], e[3], -e[0] + e[1]]) + noise[2:]
    x, y = torch.nn.functional.normalize(x, dim=1), torch.nn.functional.normalize(y, dim=1)
    a = torch.tensor(100.0, dtype=torch.float64)
    ref = K.lse_forward(x, y, a, a, diag_offset, backend="naive")
    out = K.lse_forward(
        x.float(), y.float(), a.float(), a.float(), diag_offset, backend="torch", block_size=4
    )
    for o, r in zip(out, ref, strict=True):
        assert rel_err(o, r) <= 1e-5


def test_tiled_lse_frozen_side_gets_no_grad_and_same_other_grads(gen, monkeypatch):
    """y without requires_grad (a frozen tower): x and the scales get the same gradients as when y is
    trainable, and y's side of the backward is not computed."""
    from toolkit.kernels import tiled

    asked, real = [], tiled.lse_backward
    monkeypatch.setattr(tiled, "lse_backward", lambda *a, **k: asked.append(a[-2:]) or real(*a, **k))
    m, n, d = 9, 14, 16
    x, y = unit_rows(m, d, gen), unit_rows(n, d, gen)
    rs, cs = 3 + torch.rand(m, generator=gen), torch.tensor(7.0)
    w_r, w_c = torch.randn(m, generator=gen), torch.randn(n, generator=gen)
    grads = []
    for y_trainable in (True, False):
        xi, yi = x.clone().requires_grad_(), y.clone().requires_grad_(y_trainable)
        ri = rs.clone().requires_grad_()
        row, col = K.tiled_lse(xi, yi, ri, cs, 2, backend="torch", block_size=4)
        ((row * w_r).sum() + (col * w_c).sum()).backward()
        grads.append((xi.grad, ri.grad, yi.grad))
    assert grads[1][2] is None and grads[0][2] is not None
    assert asked == [(True, True), (True, False)]  # (compute_dx, compute_dy) of the two backwards
    assert torch.equal(grads[1][0], grads[0][0]) and torch.equal(grads[1][1], grads[0][1])
