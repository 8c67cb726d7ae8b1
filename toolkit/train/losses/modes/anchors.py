"""FastCLIP's distributed step for the CLIP objective: no communication of feature gradients.

Forward (per rank): one all_gather of the stacked (image, text) pairs [b, 2, d] -> [B, 2, d] without
autograd, this rank's anchor LSEs (rows R_r over all texts, columns C_r over all images), then one
all_gather of the per-sample scalars [b, 2] -> every anchor's global R and C [B].
Backward: each rank assembles its own feature gradients from (a) its anchor terms and (b) its role as a
negative of every gathered anchor, which ``lse_backward`` gives directly when handed global LSEs:
    dx_r = lse_backward(x_r, Y, R_r, C_all, w_r, w_all).dx,
    dy_r = lse_backward(X, y_r, R_all, C_r, w_all, w_r).dy
with w = g/(2b) per anchor. The other ranks' upstream g is taken equal to this rank's (there is no
backward communication to learn it): scale the loss only by rank-independent factors.
Per rank: feature bytes are half of gather/disco's (no reduce_scatter), plus 2·B fp32 scalars.
FastCLIP's estimators (``toolkit.train.losses.fastclip``: u, per-sample τ) build on the same pattern and share
``anchor_lses`` / ``anchor_grads`` (there with the positives masked and normalisers from u).
"""

from __future__ import annotations

import torch
from torch import Tensor

from toolkit import kernels as K
from toolkit.core import dist as D
from toolkit.train.losses.modes.common import add_positive_grads, clip_value, gather_pairs, positive_logits


def _offsets(off: int, masked: bool) -> tuple[int | None, int | None]:
    """diag_offset for this rank's rows against all columns (+off) and all rows against its columns (−off)."""
    return (off, -off) if masked else (None, None)


def anchor_lses(
    x: Tensor, y: Tensor, xs: Tensor, ys: Tensor, a: Tensor, off: int, masked: bool, backend: str
) -> tuple[Tensor, Tensor]:
    """LSEs of this rank's anchors: rows of a·x Ysᵀ [b] and columns of a·Xs yᵀ [b] (no autograd).

    x, y [b, d] this rank's rows (rows off ... off+b−1 of the global batch), xs, ys [B, d] all rows;
    ``masked`` leaves the positive pairs out of the sums (FastCLIP's g). B = b: one pass gives both."""
    if xs.shape[0] == x.shape[0]:
        return K.lse_forward(x, y, a, a, 0 if masked else None, backend=backend)
    row_k, col_k = _offsets(off, masked)
    row, _ = K.lse_forward(x, ys, a, a, row_k, compute_col=False, backend=backend)
    _, col = K.lse_forward(xs, y, a, a, col_k, compute_row=False, backend=backend)
    return row, col


def anchor_grads(
    x: Tensor,
    y: Tensor,
    xs: Tensor,
    ys: Tensor,
    a: Tensor,
    row_all: Tensor,
    col_all: Tensor,
    w: Tensor,
    off: int,
    masked: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's share of ∇ w·Σ_i (row term_i + column term_i) over the global batch, given every anchor's
    normalisers row_all, col_all [B]: (dx [b, d], dy [b, d], its anchors' part of d/da, 0-d).

    x's gradient comes from its rows (anchor terms) and from being a negative of every text anchor (all
    columns); y's likewise with the roles swapped. ``w``: 0-d upstream weight of every term. No
    communication: the gathered normalisers carry what the other ranks would have sent."""
    b, big_b = x.shape[0], xs.shape[0]
    wb, w_all = w.expand(b), w.expand(big_b)
    if big_b == b:
        dx, dy, d_row, d_col = K.lse_backward(
            x, y, a, a, row_all, col_all, wb, wb, 0 if masked else None, backend=backend
        )
        return dx, dy, d_row.sum() + d_col.sum()
    mine = slice(off, off + b)
    row_k, col_k = _offsets(off, masked)
    # each call needs one side only: skip the other's matmuls (a whole B×b pass on the triton backend)
    dx, _, d_row, _ = K.lse_backward(
        x, ys, a, a, row_all[mine], col_all, wb, w_all, row_k, backend=backend, compute_dy=False
    )
    _, dy, _, d_col = K.lse_backward(
        xs, y, a, a, row_all, col_all[mine], w_all, wb, col_k, backend=backend, compute_dx=False
    )
    return dx, dy, d_row.sum() + d_col.sum()


class _FastClipLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, a, group, backend, ledger):
        r, b = D.get_rank(group), x.shape[0]
        xs, ys = gather_pairs(x, y, group, ledger=ledger)
        row, col = anchor_lses(x, y, xs, ys, a, r * b, False, backend)
        lses = D.all_gather_nograd(
            torch.stack([row, col], 1), group, D.SCALARS, check_sizes=False, ledger=ledger
        )
        row_all, col_all = lses[:, 0].contiguous(), lses[:, 1].contiguous()
        pos = positive_logits(x, y)
        ctx.save_for_backward(x, y, a, xs, ys, row_all, col_all, pos)
        ctx.backend, ctx.off = backend, r * b
        return clip_value(row, col, a, pos)

    @staticmethod
    def backward(ctx, g):
        x, y, a, xs, ys, row_all, col_all, pos = ctx.saved_tensors
        g = g.to(row_all.dtype)
        dx, dy, da = anchor_grads(
            x, y, xs, ys, a, row_all, col_all, g / (2 * x.shape[0]), ctx.off, False, ctx.backend
        )
        dx, dy = add_positive_grads(dx, dy, x, y, a, g)
        # logit_scale: only this rank's anchors (its rows and its columns)
        da = da - g * pos.mean()
        return dx.to(x.dtype), dy.to(y.dtype), da.to(a.dtype), None, None, None


def fastclip_loss(x: Tensor, y: Tensor, a: Tensor, group=None, backend: str = "auto", ledger=None) -> Tensor:
    """FastCLIP mode (module docstring). Called by all ranks of ``group``; sizes checked by the caller."""
    return _FastClipLoss.apply(x, y, a, group, backend, ledger)
