"""Chunked PyTorch backend (``backend="torch"``): the CPU path and the fallback everywhere.

The similarity matrix is visited in row strips of ``block_size`` rows × all N columns (one strip is the
"tile": it goes through one matmul, so CPU BLAS stays efficient). Memory is one strip (plus the
temporaries of the element-wise ops on it) and O((M + N)·D) for the upcast inputs and gradients; the
backward recomputes every strip from x, y and the saved O(M + N) LSEs. Column LSEs are combined across
strips with a running ``logaddexp`` (exact, handles -inf).

Called by every rank on its own blocks; the caller (``toolkit.kernels.api``) has already validated
shapes and turned the scales into 0-d or 1-d tensors of the accumulation dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Elements per strip when block_size is None: 2^22 fp32 = 16 MiB (512 rows at N = 8192, measured
# fastest among 64..1024 on the 2-core CI box): large enough for BLAS, small next to the O(B·D) inputs.
DEFAULT_STRIP_ELEMENTS = 1 << 22


def strip_rows(m: int, n: int, block_size: int | None) -> int:
    """Rows per strip: ``block_size`` if given, else enough rows for ~DEFAULT_STRIP_ELEMENTS entries."""
    if block_size is not None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        return block_size
    return max(1, min(m, DEFAULT_STRIP_ELEMENTS // max(n, 1)))


def _diag_index(i0: int, i1: int, n: int, diag_offset: int | None, device) -> tuple[Tensor, Tensor] | None:
    """(strip-local rows, columns) of the masked entries j == i + diag_offset inside rows [i0, i1)."""
    if diag_offset is None:
        return None
    lo, hi = max(i0, -diag_offset), min(i1, n - diag_offset)
    if lo >= hi:
        return None
    rows = torch.arange(lo, hi, device=device)
    return rows - i0, rows + diag_offset


def _rows(scale: Tensor, i0: int, i1: int) -> Tensor:
    """The strip's slice of a per-row quantity as a column [bm, 1]; 0-d stays 0-d."""
    return scale if scale.dim() == 0 else scale[i0:i1, None]


def _cols(scale: Tensor) -> Tensor:
    return scale if scale.dim() == 0 else scale[None, :]


def _same_scale(row_scale: Tensor, col_scale: Tensor) -> bool:
    """True when a·s is the same tile for rows and columns (one shared scalar: the CLIP case)."""
    return row_scale is col_scale or (row_scale.dim() == 0 and col_scale.dim() == 0
                                      and bool(row_scale == col_scale))


def lse_forward(x: Tensor, y: Tensor, row_scale: Tensor, col_scale: Tensor, diag_offset: int | None,
                compute_row: bool, compute_col: bool, block_size: int | None
                ) -> tuple[Tensor | None, Tensor | None]:
    """Row LSE [M] and column LSE [N] (acc dtype) of x [M, D], y [N, D]; see ``toolkit.kernels``."""
    m, n = x.shape[0], y.shape[0]
    acc = row_scale.dtype
    xa, ya = x.to(acc), y.to(acc)
    row = torch.empty(m, dtype=acc, device=x.device) if compute_row else None
    col = torch.full((n,), float("-inf"), dtype=acc, device=x.device) if compute_col else None
    shared = _same_scale(row_scale, col_scale)
    bm = strip_rows(m, n, block_size)
    for i0 in range(0, m, bm):
        i1 = min(m, i0 + bm)
        s = xa[i0:i1] @ ya.T  # [bm, N]
        diag = _diag_index(i0, i1, n, diag_offset, x.device)
        if compute_row:
            zr = s * _rows(row_scale, i0, i1) if (compute_col and not shared) else s.mul_(_rows(row_scale, i0, i1))
            if diag is not None:
                zr[diag] = float("-inf")
            row[i0:i1] = torch.logsumexp(zr, dim=1)
        if compute_col:
            if compute_row and shared:
                zc = zr
            else:
                zc = s.mul_(_cols(col_scale))
                if diag is not None:
                    zc[diag] = float("-inf")
            torch.logaddexp(col, torch.logsumexp(zc, dim=0), out=col)
    return row, col


def _weighted_probs(s: Tensor, scale: Tensor, lse: Tensor, grad: Tensor, diag) -> Tensor:
    """grad·exp(scale·s − lse) with masked entries 0; all operands broadcast to the strip [bm, N]."""
    p = torch.mul(s, scale).sub_(lse).exp_()
    if diag is not None:
        p[diag] = 0.0
    return p.mul_(grad)


def lse_backward(x: Tensor, y: Tensor, row_scale: Tensor, col_scale: Tensor, row_lse: Tensor | None,
                 col_lse: Tensor | None, grad_row: Tensor | None, grad_col: Tensor | None,
                 diag_offset: int | None, block_size: int | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx [M, D], dy [N, D], d_row_scale [M], d_col_scale [N]) in the acc dtype, strip by strip.

    Per strip: one matmul recomputes s, then dL/ds = g_r·a_r·P + g_c·a_c·Q feeds two matmuls
    (dx rows, dy accumulation); the scale gradients are row/column sums of g·P·s and g·Q·s.
    """
    m, n = x.shape[0], y.shape[0]
    acc = row_scale.dtype
    xa, ya = x.to(acc), y.to(acc)
    dx = torch.zeros(m, x.shape[1], dtype=acc, device=x.device)
    dy = torch.zeros(n, y.shape[1], dtype=acc, device=x.device)
    d_row = torch.zeros(m, dtype=acc, device=x.device)
    d_col = torch.zeros(n, dtype=acc, device=x.device)
    if grad_row is None and grad_col is None:
        return dx, dy, d_row, d_col
    bm = strip_rows(m, n, block_size)
    for i0 in range(0, m, bm):
        i1 = min(m, i0 + bm)
        s = xa[i0:i1] @ ya.T
        diag = _diag_index(i0, i1, n, diag_offset, x.device)
        w = None  # dL/ds on this strip
        if grad_row is not None:
            gp = _weighted_probs(s, _rows(row_scale, i0, i1), row_lse[i0:i1, None], grad_row[i0:i1, None], diag)
            d_row[i0:i1] = torch.linalg.vecdot(gp, s)
            w = gp.mul_(_rows(row_scale, i0, i1))
        if grad_col is not None:
            gq = _weighted_probs(s, _cols(col_scale), col_lse[None, :], grad_col[None, :], diag)
            d_col += torch.linalg.vecdot(gq, s, dim=0)
            gq.mul_(_cols(col_scale))
            w = gq if w is None else w.add_(gq)
        torch.mm(w, ya, out=dx[i0:i1])
        dy.addmm_(w.T, xa[i0:i1])
    return dx, dy, d_row, d_col
