"""Shared oracle comparisons for the kernel tests: float64 naive reference vs a backend."""

from __future__ import annotations

import torch
from torch import Tensor

from toolkit import kernels as K


def rel_err(actual: Tensor, expected: Tensor, floor: float = 0.0) -> float:
    """Norm-wise relative error ‖a − e‖₂ / max(‖e‖₂, floor·√n) over the finite entries; the non-finite
    pattern (e.g. -inf for fully masked rows) must match exactly.

    Norm-wise, because at logit scale 100 one fp32 rounding of s (~1e-7) moves exp(a·s − lse) by ~1e-5
    relative, so a single element can sit at the fp32 floor of 1e-5 even when the kernel is right.
    ``floor`` is the size of the terms the result is a difference of: at B = 1 the CLIP loss and its
    feature gradients cancel to exactly 0 in float64, which no fp32 result meets relatively.
    """
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert a.shape == e.shape, (a.shape, e.shape)
    fin = torch.isfinite(e)
    assert torch.equal(torch.isfinite(a), fin), f"non-finite pattern differs:\n{a}\n{e}"
    assert torch.equal(a[~fin], e[~fin]), "infinities differ"
    if not fin.any():
        return 0.0
    denom = max(e[fin].norm().item(), floor * fin.sum().item() ** 0.5, 1e-30)
    return (a[fin] - e[fin]).norm().item() / denom


def clip_floors(b: int, value: float) -> tuple[float, float, float, float]:
    """Term sizes for (loss, d_image, d_text, d_logit_scale): log-sum-exps are O(max(1, a)), feature
    gradients are sums of a/B-sized terms, the scale gradient of O(1) terms."""
    return max(1.0, value), value / b, value / b, 1.0


def unit_rows(n: int, d: int, gen: torch.Generator, dtype=torch.float32) -> Tensor:
    """L2-normalised random rows (CLIP features), rounded to ``dtype``."""
    return torch.nn.functional.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=1).to(
        dtype
    )


def make_scale(kind: str, n: int, value: float, gen: torch.Generator) -> Tensor:
    """0-d ``value`` or per-row scales in [value/2, value] (individual temperatures)."""
    if kind == "scalar":
        return torch.tensor(value, dtype=torch.float64)
    return value * (0.5 + 0.5 * torch.rand(n, generator=gen, dtype=torch.float64))


def check_lse_case(
    backend: str,
    m: int,
    n: int,
    d: int,
    diag_offset,
    row_kind: str,
    col_kind: str,
    value: float,
    block_size,
    dtype,
    tol: float,
    gen: torch.Generator,
    device: str = "cpu",
) -> None:
    """Forward LSEs and all four backward outputs of ``backend`` (inputs on ``device``) vs the float64
    naive oracle on CPU, with random upstream weights on both sides (the oracle sees the same
    dtype-rounded inputs)."""
    x, y = unit_rows(m, d, gen, dtype), unit_rows(n, d, gen, dtype)
    rs, cs = make_scale(row_kind, m, value, gen), make_scale(col_kind, n, value, gen)
    x64, y64 = x.double(), y.double()
    ref = K.lse_forward(x64, y64, rs, cs, diag_offset, backend="naive")
    dev = {"device": device}
    out = K.lse_forward(
        x.to(**dev),
        y.to(**dev),
        rs.float().to(**dev),
        cs.float().to(**dev),
        diag_offset,
        backend=backend,
        block_size=block_size,
    )
    for name, o, r in zip(("row_lse", "col_lse"), out, ref, strict=True):
        assert o.dtype == torch.float32
        err = rel_err(o, r)
        assert err <= tol, f"{backend} {name} rel err {err:.2e} > {tol}"
    g_r, g_c = (
        torch.randn(m, generator=gen, dtype=torch.float64),
        torch.randn(n, generator=gen, dtype=torch.float64),
    )
    ref_b = K.lse_backward(x64, y64, rs, cs, ref[0], ref[1], g_r, g_c, diag_offset, backend="naive")
    args = [t.float().to(**dev) for t in (rs, cs, ref[0], ref[1], g_r, g_c)]
    out_b = K.lse_backward(
        x.to(**dev), y.to(**dev), *args, diag_offset, backend=backend, block_size=block_size
    )
    for name, o, r in zip(("dx", "dy", "d_row_scale", "d_col_scale"), out_b, ref_b, strict=True):
        assert o.dtype == torch.float32 and o.shape == r.shape, (name, o.dtype, o.shape)
        err = rel_err(o, r)
        assert err <= tol, f"{backend} {name} rel err {err:.2e} > {tol}"


def check_clip_loss(
    backend: str,
    b: int,
    d: int,
    value: float,
    block_size,
    dtype,
    tol: float,
    gen: torch.Generator,
    device: str = "cpu",
) -> None:
    """clip_loss value and gradients (features and logit_scale) vs the float64 naive loss."""
    x, y = unit_rows(b, d, gen, dtype), unit_rows(b, d, gen, dtype)
    grads = []
    for feats, scale, kw in (
        ((x.double(), y.double()), torch.tensor(value, dtype=torch.float64), dict(backend="naive")),
        (
            (x.to(device), y.to(device)),
            torch.tensor(value, device=device),
            dict(backend=backend, block_size=block_size),
        ),
    ):
        xi, yi = (f.clone().requires_grad_() for f in feats)
        a = scale.clone().requires_grad_()
        loss = K.clip_loss(xi, yi, a, **kw)
        loss.backward()
        grads.append((loss, xi.grad, yi.grad, a.grad))
    names = ("loss", "d_image", "d_text", "d_logit_scale")
    for name, o, r, floor in zip(names, grads[1], grads[0], clip_floors(b, value), strict=True):
        assert o.shape == r.shape
        err = rel_err(o, r, floor)
        assert err <= tol, f"{backend} clip_loss {name} rel err {err:.2e} > {tol}"
