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


@pytest.mark.parametrize("bad,match", [
    (lambda x, y, a: K.lse_forward(x, y[:, :3], a, a), "same feature dim"),
    (lambda x, y, a: K.lse_forward(x[0], y, a, a), "must be 2-d"),
    (lambda x, y, a: K.lse_forward(x, y, torch.ones(2), a), r"row_scale must be 0-d or \[5\]"),
    (lambda x, y, a: K.lse_forward(x, y, a, torch.ones(5)), r"col_scale must be 0-d or \[6\]"),
    (lambda x, y, a: K.lse_backward(x, y, a, a, None, None, torch.ones(5), None), "grad_row given without"),
    (lambda x, y, a: K.clip_loss(x, y[:5], torch.ones(1)), "logit_scale must be 0-d"),
    (lambda x, y, a: K.clip_loss(x, y, a), "same shape"),
])
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
        xi, yi, a = x.clone().requires_grad_(), y.clone().requires_grad_(), torch.tensor(value, requires_grad=True)
        loss = fn(xi, yi, a)
        loss.backward()
        out.append((loss, xi.grad, yi.grad, a.grad))
    names = ("loss", "d_image", "d_text", "d_logit_scale")
    for name, o, r, floor in zip(names, out[1], out[0], clip_floors(b, value), strict=True):
        err = rel_err(o, r, floor)
        assert err <= 1e-5, f"{name} rel err {err:.2e}"


def test_offdiag_mean_exp_matches_direct_formula(gen):
    """g_i = 1/(N−1) Σ_{j≠i+k} exp(a_i(s_ij − s_i,i+k)) and its gradients, vs float64 autograd on the
    formula written out over the full matrix."""
    m, n, d, k = 13, 20, 72, 4
    x, y = unit_rows(m, d, gen).double(), unit_rows(n, d, gen).double()
    a = 5.0 + 20.0 * torch.rand(m, generator=gen, dtype=torch.float64)
    w = torch.randn(m, generator=gen, dtype=torch.float64)  # upstream weights (FastCLIP's 1/u_i)
    out = []
    for direct in (True, False):
        xi, yi, ai = x.clone().requires_grad_(), y.clone().requires_grad_(), a.clone().requires_grad_()
        if direct:
            s = xi @ yi.T
            pos = s[torch.arange(m), torch.arange(m) + k]
            keep = torch.ones(m, n, dtype=torch.bool)
            keep[torch.arange(m), torch.arange(m) + k] = False
            g = (torch.exp(ai[:, None] * (s - pos[:, None])) * keep).sum(1) / (n - 1)
        else:
            g = K.offdiag_mean_exp(xi.float(), yi.float(), ai.float(), k, backend="torch", block_size=3)
        (g.double() * w).sum().backward()
        out.append((g, xi.grad, yi.grad, ai.grad))
    for name, o, r in zip(("g", "dx", "dy", "da"), out[1], out[0], strict=True):
        err = rel_err(o, r)
        assert err <= 1e-5, f"{name} rel err {err:.2e}"
    with pytest.raises(ValueError, match="positive"):
        K.offdiag_mean_exp(x, y, a, n - m + 1)


def test_naive_backend_fp32_matches_float64(gen, poisoned):
    """The naive backend is also a backend: fp32 through the dispatcher vs its own float64 run."""
    check_lse_case("naive", 29, 41, 96, -3, "per_row", "per_row", 100.0, None, torch.float32, 1e-5, gen)
    check_clip_loss("naive", 17, 72, 100.0, None, torch.float32, 1e-5, gen)
