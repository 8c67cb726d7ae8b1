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

# Elements per strip when block_size is None: 2^21 fp32 = 8 MiB (256 rows at N = 8192; 512 rows was
# ~same speed on the 2-core CI box, and 8 MiB keeps the strips well below the O(B·D) gradients).
DEFAULT_STRIP_ELEMENTS = 1 << 21


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
    return row_scale is col_scale or (
        row_scale.dim() == 0 and col_scale.dim() == 0 and bool(row_scale == col_scale)
    )


# A row/column whose sum of exp(z − strip max) falls below this lost precision to underflow (its own
# max is > ~46 below the strip's): it is recomputed exactly with its own shift.
_UNDERFLOW_SUM = 1e-20


def _exact_rows(xa, ya, rows, scale, diag_offset) -> Tensor:
    """Exact row LSE of global rows ``rows`` (scale 0-d), with their diagonal entries masked."""
    z = (xa[rows] @ ya.T).mul_(scale)
    if diag_offset is not None:
        cols = rows + diag_offset
        ok = (cols >= 0) & (cols < ya.shape[0])
        z[torch.arange(rows.shape[0], device=z.device)[ok], cols[ok]] = float("-inf")
    return torch.logsumexp(z, dim=1)


def _exact_cols(xa_blk, ya, i0, cols, scale, diag_offset) -> Tensor:
    """Exact column LSE over the strip's rows (starting at global row i0) for global columns ``cols``."""
    z = (xa_blk @ ya[cols].T).mul_(scale)
    if diag_offset is not None:
        rows = cols - diag_offset - i0  # strip-local row whose entry is masked in each column
        ok = (rows >= 0) & (rows < xa_blk.shape[0])
        z[rows[ok], torch.arange(cols.shape[0], device=z.device)[ok]] = float("-inf")
    return torch.logsumexp(z, dim=0)


def _forward_shared(xa, ya, scale, diag_offset, row, col, bm) -> None:
    """Both LSEs with one shared 0-d scale (the CLIP case) from ONE exp per strip entry: shift by the
    strip max, take row and column sums of the same exponentials, recompute underflowed lines exactly."""
    m, n = xa.shape[0], ya.shape[0]
    buf = torch.empty(min(bm, m), n, dtype=xa.dtype, device=xa.device)
    for i0 in range(0, m, bm):
        i1 = min(m, i0 + bm)
        z = torch.mm(xa[i0:i1], ya.T, out=buf[: i1 - i0]).mul_(scale)
        diag = _diag_index(i0, i1, n, diag_offset, xa.device)
        if diag is not None:
            z[diag] = float("-inf")
        shift = z.max()
        if shift == float("-inf"):  # every entry masked
            row[i0:i1] = float("-inf")
            continue
        e = z.sub_(shift).exp_()
        row_sum, col_sum = e.sum(1), e.sum(0)
        bad_rows = torch.nonzero(row_sum < _UNDERFLOW_SUM).flatten()
        bad = torch.nonzero(col_sum < _UNDERFLOW_SUM).flatten()
        row[i0:i1] = row_sum.log_().add_(shift)
        part = col_sum.log_().add_(shift)
        if bad_rows.numel():
            row[i0 + bad_rows] = _exact_rows(xa, ya, i0 + bad_rows, scale, diag_offset)
        if bad.numel():
            part[bad] = _exact_cols(xa[i0:i1], ya, i0, bad, scale, diag_offset)
        torch.logaddexp(col, part, out=col)


def lse_forward(
    x: Tensor,
    y: Tensor,
    row_scale: Tensor,
    col_scale: Tensor,
    diag_offset: int | None,
    compute_row: bool,
    compute_col: bool,
    block_size: int | None,
) -> tuple[Tensor | None, Tensor | None]:
    """Row LSE [M] and column LSE [N] (acc dtype) of x [M, D], y [N, D]; see ``toolkit.kernels``."""
    m, n = x.shape[0], y.shape[0]
    acc = row_scale.dtype
    xa, ya = x.to(acc), y.to(acc)
    row = torch.empty(m, dtype=acc, device=x.device) if compute_row else None
    col = torch.full((n,), float("-inf"), dtype=acc, device=x.device) if compute_col else None
    shared = _same_scale(row_scale, col_scale)
    bm = strip_rows(m, n, block_size)
    if compute_row and compute_col and shared:
        _forward_shared(xa, ya, row_scale, diag_offset, row, col, bm)
        return row, col
    for i0 in range(0, m, bm):
        i1 = min(m, i0 + bm)
        s = xa[i0:i1] @ ya.T  # [bm, N]
        diag = _diag_index(i0, i1, n, diag_offset, x.device)
        if compute_row:
            zr = s * _rows(row_scale, i0, i1) if compute_col else s.mul_(_rows(row_scale, i0, i1))
            if diag is not None:
                zr[diag] = float("-inf")
            row[i0:i1] = torch.logsumexp(zr, dim=1)
        if compute_col:
            zc = s.mul_(_cols(col_scale))
            if diag is not None:
                zc[diag] = float("-inf")
            torch.logaddexp(col, torch.logsumexp(zc, dim=0), out=col)
    return row, col


def _probs(z: Tensor, lse: Tensor, diag, out: Tensor) -> Tensor:
    """exp(z − lse) into ``out`` with the masked entries 0; lse broadcasts as [bm, 1] or [1, N]."""
    p = torch.sub(z, lse, out=out).exp_()
    if diag is not None:
        p[diag] = 0.0
    return p


def lse_backward(
    x: Tensor,
    y: Tensor,
    row_scale: Tensor,
    col_scale: Tensor,
    row_lse: Tensor | None,
    col_lse: Tensor | None,
    grad_row: Tensor | None,
    grad_col: Tensor | None,
    diag_offset: int | None,
    block_size: int | None,
    compute_dx: bool = True,
    compute_dy: bool = True,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """(dx [M, D], dy [N, D], d_row_scale [M], d_col_scale [N]) in the acc dtype, strip by strip; the x side
    (dx, d_row_scale) / y side (dy, d_col_scale) is None and skipped with compute_dx / compute_dy False.

    Per strip: one matmul recomputes s, then dL/ds = g_r·a_r·P + g_c·a_c·Q feeds two matmuls
    (dx rows, dy accumulation); the scale gradients are row/column sums of g·P·s and g·Q·s.
    """
    m, n = x.shape[0], y.shape[0]
    acc = row_scale.dtype
    xa, ya = x.to(acc), y.to(acc)
    dx = torch.zeros(m, x.shape[1], dtype=acc, device=x.device) if compute_dx else None
    dy = torch.zeros(n, y.shape[1], dtype=acc, device=x.device) if compute_dy else None
    d_row = torch.zeros(m, dtype=acc, device=x.device) if compute_dx else None
    d_col = torch.zeros(n, dtype=acc, device=x.device) if compute_dy else None
    if (grad_row is None and grad_col is None) or not (compute_dx or compute_dy):
        return dx, dy, d_row, d_col
    bm = strip_rows(m, n, block_size)
    shared = _same_scale(row_scale, col_scale)
    rows_n = min(bm, m)
    s_buf, z_buf, p_buf, q_buf = (torch.empty(rows_n, n, dtype=acc, device=x.device) for _ in range(4))
    # Upstream weight × scale per line: W = (g_r a_r) ∘ P + (g_c a_c) ∘ Q.
    f_row = None if grad_row is None else grad_row * row_scale
    f_col = None if grad_col is None else (grad_col * col_scale)[None, :]
    for i0 in range(0, m, bm):
        i1 = min(m, i0 + bm)
        k = i1 - i0
        s = torch.mm(xa[i0:i1], ya.T, out=s_buf[:k])
        diag = _diag_index(i0, i1, n, diag_offset, x.device)
        z_row = (
            torch.mul(s, _rows(row_scale, i0, i1), out=z_buf[:k]) if grad_row is not None or shared else None
        )
        w = None  # dL/ds on this strip
        if grad_row is not None:
            p = _probs(z_row, row_lse[i0:i1, None], diag, p_buf[:k])
            if compute_dx:
                d_row[i0:i1] = torch.linalg.vecdot(p, s).mul_(grad_row[i0:i1])
            w = p.mul_(f_row[i0:i1, None])
        if grad_col is not None:
            z_col = z_row if shared else torch.mul(s, _cols(col_scale), out=z_buf[:k])
            q = _probs(z_col, col_lse[None, :], diag, q_buf[:k])
            if compute_dy:
                d_col.add_(torch.linalg.vecdot(q, s, dim=0).mul_(grad_col))
            w = q.mul_(f_col) if w is None else w.addcmul_(q, f_col)
        if compute_dx:
            torch.mm(w, ya, out=dx[i0:i1])
        if compute_dy:
            dy.addmm_(w.T, xa[i0:i1])
    return dx, dy, d_row, d_col
