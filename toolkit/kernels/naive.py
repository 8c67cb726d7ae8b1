"""Full-matrix contrastive LSE: the ``naive`` backend, for tests and benchmarks (O(M·N) memory).

This module fixes the contract every backend (torch tiles, Triton) implements; see
``toolkit/kernels/__init__.py`` for the public API.
"""

from __future__ import annotations

import torch
from torch import Tensor

from toolkit.kernels.common import accumulation_dtype


def _mask(m: int, n: int, diag_offset: int | None, device) -> Tensor | None:
    if diag_offset is None:
        return None
    i = torch.arange(m, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    return j == i + diag_offset


def _scaled(x: Tensor, y: Tensor, row_scale: Tensor, col_scale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """s = x·yᵀ in fp32 (fp64 stays fp64); returns (s, row_scale_i·s_ij, col_scale_j·s_ij)."""
    acc = accumulation_dtype(x)
    s = x.to(acc) @ y.to(acc).T
    return s, row_scale.to(acc).reshape(-1, 1) * s, col_scale.to(acc).reshape(1, -1) * s


def lse_forward(
    x: Tensor,
    y: Tensor,
    row_scale: Tensor,
    col_scale: Tensor,
    diag_offset: int | None = None,
    compute_row: bool = True,
    compute_col: bool = True,
) -> tuple[Tensor | None, Tensor | None]:
    """Row and column log-sum-exp of scaled similarities; see ``toolkit.kernels.lse_forward``."""
    s, zr, zc = _scaled(x, y, row_scale, col_scale)
    mask = _mask(s.shape[0], s.shape[1], diag_offset, s.device)
    if mask is not None:
        zr, zc = zr.masked_fill(mask, float("-inf")), zc.masked_fill(mask, float("-inf"))
    row = torch.logsumexp(zr, dim=1) if compute_row else None
    col = torch.logsumexp(zc, dim=0) if compute_col else None
    return row, col


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
    compute_dx: bool = True,
    compute_dy: bool = True,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """Gradients (dx, dy, d_row_scale, d_col_scale) given the LSEs and their upstream gradients; the x side
    (dx, d_row_scale) and the y side (dy, d_col_scale) are None when not asked for."""
    s, zr, zc = _scaled(x, y, row_scale, col_scale)
    acc = s.dtype
    m, n = s.shape
    mask = _mask(m, n, diag_offset, s.device)
    w = torch.zeros_like(s)  # dL/ds_ij
    d_row = torch.zeros(m, dtype=acc, device=s.device)
    d_col = torch.zeros(n, dtype=acc, device=s.device)
    if grad_row is not None:
        p = torch.exp(zr - row_lse.to(acc).reshape(-1, 1))
        if mask is not None:
            p = p.masked_fill(mask, 0.0)
        gp = grad_row.to(acc).reshape(-1, 1) * p
        w = w + gp * row_scale.to(acc).reshape(-1, 1)
        d_row = (gp * s).sum(1)
    if grad_col is not None:
        q = torch.exp(zc - col_lse.to(acc).reshape(1, -1))
        if mask is not None:
            q = q.masked_fill(mask, 0.0)
        gq = grad_col.to(acc).reshape(1, -1) * q
        w = w + gq * col_scale.to(acc).reshape(1, -1)
        d_col = (gq * s).sum(0)
    dx = w @ y.to(acc) if compute_dx else None
    dy = w.T @ x.to(acc) if compute_dy else None
    return dx, dy, (d_row if compute_dx else None), (d_col if compute_dy else None)


def clip_loss(image_features: Tensor, text_features: Tensor, logit_scale: Tensor) -> Tensor:
    """½(CE image→text + CE text→image) with positives on the diagonal, by plain autograd."""
    logits = logit_scale * image_features @ text_features.T
    labels = torch.arange(logits.shape[0], device=logits.device)
    return 0.5 * (
        torch.nn.functional.cross_entropy(logits, labels)
        + torch.nn.functional.cross_entropy(logits.T, labels)
    )
