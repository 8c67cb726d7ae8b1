"""Public entry points of ``toolkit.kernels``: input checks, backend dispatch, autograd, CLIP loss.

Every rank calls these on its own blocks (the distributed modes pass local x against gathered or
ring-passed y with ``diag_offset = rank·b``). See the package docstring for the formulas.
"""

from __future__ import annotations

import torch
from torch import Tensor

from toolkit.kernels import naive, tiled
from toolkit.kernels.common import accumulation_dtype, clip_value

BACKENDS = ("auto", "naive", "torch", "triton")


def triton_available() -> bool:
    """True when ``import triton`` works (it is imported here, so set TRITON_INTERPRET before on CPU)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """``auto`` → ``triton`` for CUDA tensors when triton imports, else ``torch``; others unchanged.

    fp32 features with fp32 matmuls at "highest" precision (torch's default: no TF32) go to ``torch`` on
    CUDA too: Triton's IEEE fp32 dot runs on the CUDA cores, and on one H100 (B = 8,192, d = 512, fwd +
    bwd) it took 586 ms against 25.5 ms for the chunked torch backend (benchmarks/gpu/check.py; bf16: Triton
    2.8 ms against 24.3 ms). ``dtype`` None: the features' dtype is not known, as before.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernels backend {backend!r}; choose one of {BACKENDS}")
    if backend != "auto":
        return backend
    if device.type != "cuda" or not triton_available():
        return "torch"
    ieee_fp32 = dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"
    return "torch" if ieee_fp32 else "triton"


def _check_inputs(x: Tensor, y: Tensor, row_scale: Tensor, col_scale: Tensor) -> None:
    if x.dim() != 2 or y.dim() != 2:
        raise ValueError(f"x and y must be 2-d [rows, D]; got x {tuple(x.shape)}, y {tuple(y.shape)}")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y need the same feature dim D; got x {tuple(x.shape)}, y {tuple(y.shape)}")
    if x.device != y.device:
        raise ValueError(f"x on {x.device} but y on {y.device}")
    for name, scale, rows in (("row_scale", row_scale, x.shape[0]), ("col_scale", col_scale, y.shape[0])):
        if not isinstance(scale, Tensor):
            raise TypeError(f"{name} must be a tensor (0-d or [{rows}]), got {type(scale).__name__}")
        if scale.dim() > 1 or (scale.dim() == 1 and scale.shape[0] != rows):
            raise ValueError(f"{name} must be 0-d or [{rows}], got shape {tuple(scale.shape)}")


def _scale(scale: Tensor, acc: torch.dtype, device: torch.device) -> Tensor:
    return scale.detach().to(device=device, dtype=acc)


def _vec(t: Tensor | None, n: int, acc: torch.dtype, name: str) -> Tensor | None:
    if t is None:
        return None
    t = t.detach().to(acc).reshape(-1)
    if t.shape[0] != n:
        raise ValueError(f"{name} must have {n} entries, got {t.shape[0]}")
    return t


def lse_forward(
    x: Tensor,
    y: Tensor,
    row_scale: Tensor,
    col_scale: Tensor,
    diag_offset: int | None = None,
    compute_row: bool = True,
    compute_col: bool = True,
    *,
    backend: str = "auto",
    block_size: int | None = None,
    input_precision: str | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """Row LSE [M] and column LSE [N] of row_scale_i·s_ij / col_scale_j·s_ij (None when not computed).

    x [M, D], y [N, D] (fp32/bf16/fp16; fp64 for oracles), scales 0-d or [M]/[N]. Returns fp32
    (fp64 for fp64 inputs). No autograd: use ``tiled_lse`` for that. ``input_precision`` ("ieee" or
    "tf32") only affects the triton backend's fp32 dots; None follows torch's fp32 matmul precision.
    """
    _check_inputs(x, y, row_scale, col_scale)
    x, y = x.detach(), y.detach()
    acc = accumulation_dtype(x)
    rs, cs = _scale(row_scale, acc, x.device), _scale(col_scale, acc, x.device)
    which = resolve_backend(backend, x.device, x.dtype)
    if which == "naive":
        return naive.lse_forward(x, y, rs, cs, diag_offset, compute_row, compute_col)
    if which == "torch":
        return tiled.lse_forward(x, y, rs, cs, diag_offset, compute_row, compute_col, block_size)
    from toolkit.kernels import triton_lse

    return triton_lse.lse_forward(
        x, y, rs, cs, diag_offset, compute_row, compute_col, block_size, input_precision
    )


def lse_backward(
    x: Tensor,
    y: Tensor,
    row_scale: Tensor,
    col_scale: Tensor,
    row_lse: Tensor | None,
    col_lse: Tensor | None,
    grad_row: Tensor | None,
    grad_col: Tensor | None,
    diag_offset: int | None = None,
    *,
    backend: str = "auto",
    block_size: int | None = None,
    input_precision: str | None = None,
    compute_dx: bool = True,
    compute_dy: bool = True,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """(dx [M, D], dy [N, D], d_row_scale [M], d_col_scale [N]), fp32 (fp64 for fp64 inputs).

    ``row_lse``/``col_lse`` are whatever normalisers the caller's objective uses (local, global, or
    FastCLIP's log-estimators); the formula is evaluated with them tile by tile. ``grad_row``/
    ``grad_col`` None means zero upstream gradient for that side (its LSE may then be None too).
    ``compute_dx=False`` / ``compute_dy=False``: that side's outputs (dx and d_row_scale / dy and
    d_col_scale) come back None and their matmuls (the triton backend: a whole kernel pass) are skipped.
    """
    _check_inputs(x, y, row_scale, col_scale)
    x, y = x.detach(), y.detach()
    acc = accumulation_dtype(x)
    m, n = x.shape[0], y.shape[0]
    rs, cs = _scale(row_scale, acc, x.device), _scale(col_scale, acc, x.device)
    grad_row, grad_col = _vec(grad_row, m, acc, "grad_row"), _vec(grad_col, n, acc, "grad_col")
    if grad_row is not None and row_lse is None:
        raise ValueError("grad_row given without row_lse")
    if grad_col is not None and col_lse is None:
        raise ValueError("grad_col given without col_lse")
    row_lse = _vec(row_lse, m, acc, "row_lse") if grad_row is not None else None
    col_lse = _vec(col_lse, n, acc, "col_lse") if grad_col is not None else None
    which = resolve_backend(backend, x.device, x.dtype)
    if which == "naive":
        return naive.lse_backward(
            x, y, rs, cs, row_lse, col_lse, grad_row, grad_col, diag_offset, compute_dx, compute_dy
        )
    if which == "torch":
        return tiled.lse_backward(
            x,
            y,
            rs,
            cs,
            row_lse,
            col_lse,
            grad_row,
            grad_col,
            diag_offset,
            block_size,
            compute_dx,
            compute_dy,
        )
    from toolkit.kernels import triton_lse

    return triton_lse.lse_backward(
        x,
        y,
        rs,
        cs,
        row_lse,
        col_lse,
        grad_row,
        grad_col,
        diag_offset,
        block_size,
        input_precision,
        compute_dx,
        compute_dy,
    )


def _reduce_like(grad: Tensor, scale: Tensor) -> Tensor:
    """Gradient of a 0-d (broadcast) scale is the sum of the per-row gradients."""
    return (grad.sum() if scale.dim() == 0 else grad).to(scale.dtype)


class TiledLSE(torch.autograd.Function):
    """Autograd wrapper: saves x, y, scales and the O(M + N) LSEs; backward recomputes tiles (only the
    side(s) whose inputs need a gradient: a frozen y or x costs no matmuls)."""

    @staticmethod
    def forward(
        ctx,
        x,
        y,
        row_scale,
        col_scale,
        diag_offset,
        compute_row,
        compute_col,
        backend,
        block_size,
        input_precision,
    ):
        row, col = lse_forward(
            x,
            y,
            row_scale,
            col_scale,
            diag_offset,
            compute_row,
            compute_col,
            backend=backend,
            block_size=block_size,
            input_precision=input_precision,
        )
        ctx.save_for_backward(x, y, row_scale, col_scale, *(t for t in (row, col) if t is not None))
        ctx.opts = (diag_offset, compute_row, compute_col, backend, block_size, input_precision)
        ctx.set_materialize_grads(False)  # an unused output gets None, so its side of the backward is skipped
        return row, col

    @staticmethod
    def backward(ctx, grad_row, grad_col):
        diag_offset, compute_row, compute_col, backend, block_size, input_precision = ctx.opts
        x, y, row_scale, col_scale, *lses = ctx.saved_tensors
        row = lses.pop(0) if compute_row else None
        col = lses.pop(0) if compute_col else None
        need = ctx.needs_input_grad
        dx, dy, d_rs, d_cs = lse_backward(
            x,
            y,
            row_scale,
            col_scale,
            row,
            col,
            grad_row if compute_row else None,
            grad_col if compute_col else None,
            diag_offset,
            backend=backend,
            block_size=block_size,
            input_precision=input_precision,
            compute_dx=need[0] or need[2],
            compute_dy=need[1] or need[3],
        )
        return (
            None if dx is None else dx.to(x.dtype),
            None if dy is None else dy.to(y.dtype),
            None if d_rs is None else _reduce_like(d_rs, row_scale),
            None if d_cs is None else _reduce_like(d_cs, col_scale),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def tiled_lse(
    x: Tensor,
    y: Tensor,
    row_scale: Tensor,
    col_scale: Tensor,
    diag_offset: int | None = None,
    *,
    backend: str = "auto",
    block_size: int | None = None,
    compute_row: bool = True,
    compute_col: bool = True,
    input_precision: str | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """``lse_forward`` with autograd to x, y, row_scale and col_scale (0-d scales get a 0-d grad)."""
    _check_inputs(x, y, row_scale, col_scale)
    return TiledLSE.apply(
        x,
        y,
        row_scale,
        col_scale,
        diag_offset,
        compute_row,
        compute_col,
        backend,
        block_size,
        input_precision,
    )


def _pair_dots(x: Tensor, y: Tensor, acc: torch.dtype) -> Tensor:
    """s_ii = <x_i, y_i> [B] in ``acc``, as B batched dots (no [B, D] product temporary)."""
    return torch.bmm(x.to(acc)[:, None, :], y.to(acc)[:, :, None]).reshape(-1)


class ClipLossFn(torch.autograd.Function):
    """½ mean_i (r_i − a s_ii) + ½ mean_j (c_j − a s_jj) in one Function: the positive-pair term is
    folded into the tiled backward's dx/dy in place, so beyond the O(B) LSEs the loss costs only the
    tiles and the two gradient matrices (no [B, D] temporaries for the positives)."""

    @staticmethod
    def forward(ctx, x, y, scale, backend, block_size, input_precision):
        row, col = lse_forward(
            x, y, scale, scale, backend=backend, block_size=block_size, input_precision=input_precision
        )
        pos = _pair_dots(x.detach(), y.detach(), row.dtype)
        ctx.save_for_backward(x, y, scale, row, col, pos)
        ctx.opts = (backend, block_size, input_precision)
        return clip_value(row, col, scale, pos)

    @staticmethod
    def backward(ctx, grad):
        x, y, scale, row, col, pos = ctx.saved_tensors
        backend, block_size, input_precision = ctx.opts
        b = x.shape[0]
        g = grad.to(row.dtype)
        half = (0.5 * g / b).expand(b)
        dx, dy, d_rs, d_cs = lse_backward(
            x,
            y,
            scale,
            scale,
            row,
            col,
            half,
            half,
            backend=backend,
            block_size=block_size,
            input_precision=input_precision,
        )
        coef = scale.detach().to(row.dtype) * g / b  # 0-d: no host sync, no [B, D] temporary
        dx.addcmul_(y.detach().to(dx.dtype), coef, value=-1.0)  # d(−a·mean s_ii)/dx_i = −a/B · y_i
        dy.addcmul_(x.detach().to(dy.dtype), coef, value=-1.0)
        d_scale = d_rs.sum() + d_cs.sum() - g * pos.mean()
        return dx.to(x.dtype), dy.to(y.dtype), d_scale.to(scale.dtype), None, None, None


def as_scale(logit_scale: Tensor | float, device: torch.device) -> Tensor:
    """The logit scale as a 0-d tensor (a float becomes one on ``device``); any other shape is refused."""
    if not isinstance(logit_scale, Tensor):
        logit_scale = torch.tensor(float(logit_scale), device=device)
    if logit_scale.dim() != 0:
        raise ValueError(f"logit_scale must be 0-d, got shape {tuple(logit_scale.shape)}")
    return logit_scale


def clip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    *,
    backend: str = "auto",
    block_size: int | None = None,
    input_precision: str | None = None,
) -> Tensor:
    """½(CE image→text + CE text→image), positives on the diagonal; value and gradients as open_clip's
    ``ClipLoss()`` on one process. Features [B, D]; ``logit_scale`` the multiplicative scale (0-d).
    Returns a 0-d fp32 loss (fp64 for fp64 features).
    """
    if image_features.shape != text_features.shape:
        raise ValueError(
            f"image_features {tuple(image_features.shape)} and text_features "
            f"{tuple(text_features.shape)} must have the same shape [B, D]"
        )
    logit_scale = as_scale(logit_scale, image_features.device)
    _check_inputs(image_features, text_features, logit_scale, logit_scale)
    if resolve_backend(backend, image_features.device, image_features.dtype) == "naive":
        return naive.clip_loss(image_features, text_features, logit_scale)
    return ClipLossFn.apply(image_features, text_features, logit_scale, backend, block_size, input_precision)
