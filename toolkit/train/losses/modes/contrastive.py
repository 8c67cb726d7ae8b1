"""The global-batch CLIP loss across K ranks in four communication modes; entry point ``contrastive_loss``.

Objective (K ranks, local batch b, global batch B = K·b, scale a = logit_scale.exp()): with image rows
x_i, text rows y_j over the *global* batch, R_i = log Σ_j exp(a x_i·y_j), C_j = log Σ_i exp(a x_i·y_j),
the global loss is L = 1/(2B) Σ_i (R_i − a s_ii) + 1/(2B) Σ_j (C_j − a s_jj) (open_clip's ClipLoss on the
concatenated batch).

Gradient scale convention (every mode): rank r returns its *local* loss
    loss_r = 1/(2b) Σ_{i local} (R_i − a s_ii) + 1/(2b) Σ_{j local} (C_j − a s_jj),
whose mean over ranks is L, and its backward gives rank r the gradient of S = Σ_r' loss_r' (= K·L) with
respect to rank r's own inputs: its features (K × their share of ∇L, "OpenCLIP's N× feature grads") and
its copy of logit_scale (∂loss_r/∂a). DDP's mean over ranks then yields exactly ∇θ L, the K=1 gradient
on the concatenated global batch. Multiply the loss by anything (accumulation 1/n, a GradScaler's
scale) only by factors equal on every rank: ``fastclip`` assumes so (it has no backward communication),
the other modes carry each rank's own upstream gradient. Log ``mean_over_ranks(loss)`` for L.

Every mode evaluates ``toolkit.kernels.lse_forward``/``lse_backward`` on [b, d] × [n, d] blocks with the one
scalar scale a for rows and columns (``backend`` as there: auto, torch, triton or naive).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from toolkit import kernels as K
from toolkit.core import dist as D
from toolkit.train.losses.config import MODES
from toolkit.train.losses.modes.anchors import fastclip_loss
from toolkit.train.losses.modes.common import (
    add_positive_grads,
    check_local_pair,
    checked_scale,
    clip_value,
    gather_pairs,
    positive_logits,
)
from toolkit.train.losses.modes.ring import ring_loss


class _SideLSE(torch.autograd.Function):
    """One side of the LSE of a·x yᵀ with autograd: rows (over y) or columns (over x)."""

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, a: Tensor, side: str, backend: str):
        row, col = K.lse_forward(
            x, y, a, a, compute_row=side == "row", compute_col=side == "col", backend=backend
        )
        out = row if side == "row" else col
        ctx.save_for_backward(x, y, a, out)
        ctx.side, ctx.backend = side, backend
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, y, a, out = ctx.saved_tensors
        if ctx.side == "row":
            dx, dy, da, _ = K.lse_backward(x, y, a, a, out, None, grad, None, backend=ctx.backend)
        else:
            dx, dy, _, da = K.lse_backward(x, y, a, a, None, out, None, grad, backend=ctx.backend)
        return dx.to(x.dtype), dy.to(y.dtype), da.sum().to(a.dtype), None, None


def gather_loss(x: Tensor, y: Tensor, a: Tensor, group=None, backend: str = "auto", ledger=None) -> Tensor:
    """OpenCLIP's local loss with gather_with_grad: autograd all_gathers of x and y [b, d] -> [B, d]
    (forward 2 all_gathers of [b, d]); their backward reduce-scatters the [B, d] gradients (2 calls).
    Logits b×B. Called by all ranks of ``group``; sizes checked by the caller."""
    xs = D.all_gather_with_grad(x, group, check_sizes=False, ledger=ledger)
    ys = D.all_gather_with_grad(y, group, check_sizes=False, ledger=ledger)
    row = _SideLSE.apply(x, ys, a, "row", backend)
    col = _SideLSE.apply(xs, y, a, "col", backend)
    acc = row.dtype
    # The positive logit a·s_ii is local (OpenCLIP reads it from the gathered copy at row r·b + i; its
    # gradient comes back to this rank by the reduce_scatter either way); autograd differentiates it here.
    pos = (x.to(acc) * y.to(acc)).sum(1)
    return clip_value(row, col, a, pos)


class _DiscoLoss(torch.autograd.Function):
    """DisCo-CLIP: all_gather without autograd, local b×B logits, backward reduce-scatters the [B, d]
    feature-gradient contributions of this rank's anchors (one reduce_scatter of [B, 2, d])."""

    @staticmethod
    def forward(ctx, x, y, a, group, backend, ledger):
        xs, ys = gather_pairs(x, y, group, ledger=ledger)
        row, _ = K.lse_forward(x, ys, a, a, compute_col=False, backend=backend)
        _, col = K.lse_forward(xs, y, a, a, compute_row=False, backend=backend)
        pos = positive_logits(x, y)
        ctx.save_for_backward(x, y, a, xs, ys, row, col, pos)
        ctx.group, ctx.backend, ctx.ledger = group, backend, ledger
        return clip_value(row, col, a, pos)

    @staticmethod
    def backward(ctx, g):
        x, y, a, xs, ys, row, col, pos = ctx.saved_tensors
        b = x.shape[0]
        g = g.to(row.dtype)
        w = (g / (2 * b)).expand(b).contiguous()
        dx, dys, da_row, _ = K.lse_backward(x, ys, a, a, row, None, w, None, backend=ctx.backend)
        dxs, dy, _, da_col = K.lse_backward(xs, y, a, a, None, col, None, w, backend=ctx.backend)
        # Contributions to every rank's rows, summed over ranks: one reduce_scatter of [B, 2, d],
        # in the feature dtype (what gather's autograd reduce-scatters too).
        mine = D.reduce_scatter_sum(
            torch.stack([dxs, dys], 1).to(x.dtype), ctx.group, D.FEATURE_GRADS, ctx.ledger
        )
        dx, dy = add_positive_grads(dx + mine[:, 0], dy + mine[:, 1], x, y, a, g)
        da = da_row.sum() + da_col.sum() - g * pos.mean()
        return dx.to(x.dtype), dy.to(y.dtype), da.to(a.dtype), None, None, None


def disco_loss(x: Tensor, y: Tensor, a: Tensor, group=None, backend: str = "auto", ledger=None) -> Tensor:
    """DisCo-CLIP mode (see ``_DiscoLoss``). Called by all ranks of ``group``; sizes checked by the caller."""
    return _DiscoLoss.apply(x, y, a, group, backend, ledger)


MODE_FNS: dict[str, Callable[..., Tensor]] = {
    "gather": gather_loss,
    "disco": disco_loss,
    "ring": ring_loss,
    "fastclip": fastclip_loss,
}


def contrastive_loss(
    image_local: Tensor,
    text_local: Tensor,
    logit_scale: Tensor | float,
    *,
    mode: str,
    group=None,
    backend: str = "auto",
    ledger: D.CommLedger | None = None,
    check_sizes: bool = True,
) -> Tensor:
    """This rank's share loss_r (0-d, fp32) of the global-batch CLIP loss (module docstring).

    image_local, text_local: [b, d] L2-normalised features of this rank's b pairs (same b on every rank,
    checked unless ``check_sizes`` is False, for callers whose data guarantees it (the trainer's loader):
    a mismatch raises ValueError naming each rank's shape). logit_scale: the multiplicative
    scale a (open_clip's ``logit_scale.exp()``), 0-d. mode: one of ``MODES``. Called by every rank of
    ``group`` (default: world); without a process group every mode is the K=1 loss. Collectives are
    recorded in ``ledger`` (default ``toolkit.core.dist.LEDGER``).
    """
    check_local_pair(image_local, text_local, mode, MODES, "loss", backend)  # before any collective
    logit_scale = checked_scale(logit_scale, image_local, group, ledger, check_sizes)
    return MODE_FNS[mode](image_local, text_local, logit_scale, group=group, backend=backend, ledger=ledger)


def mean_over_ranks(value: Tensor, group=None, ledger: D.CommLedger | None = None) -> Tensor:
    """Mean of a 0-d tensor over the ranks of ``group`` (e.g. loss_r -> the global loss L), for logging;
    one all_reduce of 4 or 8 bytes (category ``scalars``); called by all ranks."""
    k = D.get_world_size(group)
    out = value.detach().clone().reshape(1)
    return (D.all_reduce_sum(out, group, D.SCALARS, ledger) / k).reshape(())
