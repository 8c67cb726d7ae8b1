"""FastCLIP's distributed step for the CLIP objective: no communication of feature gradients.

Forward (per rank): one all_gather of the stacked (image, text) pairs [b, 2, d] -> [B, 2, d] without
autograd, this rank's anchor LSEs (rows R_r over all texts, columns C_r over all images), then one
all_gather of the per-sample scalars [b, 2] -> every anchor's global R and C [B].
Backward: each rank assembles its own feature gradients from (a) its anchor terms and (b) its role as a
negative of every gathered anchor, which ``lse_backward`` gives directly when handed global LSEs:
    dx_r = lse_backward(x_r, Y, R_r, C_all, w_r, w_all).dx,   dy_r = lse_backward(X, y_r, R_all, C_r, w_all, w_r).dy
with w = g/(2b) per anchor. The other ranks' upstream g is taken equal to this rank's (there is no
backward communication to learn it): scale the loss only by rank-independent factors.
Per rank: feature bytes are half of gather/disco's (no reduce_scatter), plus 2·B fp32 scalars.
FastCLIP's estimators (u, per-sample τ) build on the same pattern: gather features and per-sample
scalars once, then ``lse_backward`` with the global normalisers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from toolkit import kernels as K
from toolkit.core import dist as D
from toolkit.train.dist.losses import _add_positive_grads, _split_pairs, positive_logits


class _FastClipLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, a, group, backend, ledger):
        r, b = D.get_rank(group), x.shape[0]
        pairs = D.all_gather_nograd(torch.stack([x, y], 1), group, D.FEATURES, check_sizes=False, ledger=ledger)
        xs, ys = _split_pairs(pairs)
        row, _ = K.lse_forward(x, ys, a, a, compute_col=False, backend=backend)
        _, col = K.lse_forward(xs, y, a, a, compute_row=False, backend=backend)
        lses = D.all_gather_nograd(torch.stack([row, col], 1), group, D.SCALARS, check_sizes=False, ledger=ledger)
        row_all, col_all = lses[:, 0].contiguous(), lses[:, 1].contiguous()
        pos = positive_logits(x, y)
        ctx.save_for_backward(x, y, a, xs, ys, row_all, col_all, pos)
        ctx.backend, ctx.local = backend, slice(r * b, (r + 1) * b)
        return 0.5 * (row.mean() + col.mean()) - a.to(row.dtype) * pos.mean()

    @staticmethod
    def backward(ctx, g):
        x, y, a, xs, ys, row_all, col_all, pos = ctx.saved_tensors
        b, big_b = x.shape[0], xs.shape[0]
        g = g.to(row_all.dtype)
        w_local = (g / (2 * b)).expand(b).contiguous()
        w_all = (g / (2 * b)).expand(big_b).contiguous()
        row, col = row_all[ctx.local], col_all[ctx.local]
        # Local images: as anchors (their rows) and as negatives of every text anchor (all columns).
        dx, _, da_row, _ = K.lse_backward(x, ys, a, a, row, col_all, w_local, w_all, backend=ctx.backend)
        # Local texts: as anchors (their columns) and as negatives of every image anchor (all rows).
        _, dy, _, da_col = K.lse_backward(xs, y, a, a, row_all, col, w_all, w_local, backend=ctx.backend)
        dx, dy = _add_positive_grads(dx, dy, x, y, a, g)
        # logit_scale: only this rank's anchors (its rows in the first call, its columns in the second).
        da = da_row.sum() + da_col.sum() - g * pos.mean()
        return dx.to(x.dtype), dy.to(y.dtype), da.to(a.dtype), None, None, None


def fastclip_loss(x: Tensor, y: Tensor, a: Tensor, group=None, backend: str = "auto", ledger=None) -> Tensor:
    """FastCLIP mode (module docstring). Called by all ranks of ``group``; sizes checked by the caller."""
    return _FastClipLoss.apply(x, y, a, group, backend, ledger)
