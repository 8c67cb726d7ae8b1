"""Inf-CL's ring mode: text blocks travel rank → rank+1 while each rank works on the block in hand.

Rank r keeps its image rows x_r [b, d] and sees every text block y_s [b, d] once, s = r, r−1, ..., r−K+1.
On each block it evaluates the tile(s) of a·x_r y_sᵀ with the kernels (memory: tiles plus O(b·d)):
- forward: its row LSEs R_r accumulate locally; the column LSE partials of block s travel with a
  *travelling accumulator* [b] behind the block and arrive complete at their owner s;
- backward: the blocks re-circulate with their column LSEs and upstream gradients [2, b]; dx_r accumulates
  locally, and each block's dy (plus its share of d logit_scale) travels as an fp32 accumulator [b, d]
  that reaches its owner after visiting every rank.
Each hop is one ``batch_isend_irecv`` posted before the tile computation and waited after it, so the
transfer overlaps the compute. Per rank: K−1 block hops and K−1 accumulator hops in each direction.
World size 1 (or no process group) runs the single local tile with no communication.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from toolkit import kernels as K
from toolkit.core import dist as D
from toolkit.train.losses.modes.common import add_positive_grads, clip_value, positive_logits

Combine = Callable[[Sequence[Tensor], Sequence[Tensor]], list[Tensor]]


def circulate(
    block: Sequence[Tensor],
    block_cats: Sequence[str],
    compute: Callable[[Sequence[Tensor]], list[Tensor]],
    combine: Combine,
    acc_cats: Sequence[str],
    group=None,
    ledger=None,
) -> list[Tensor]:
    """Pass this rank's ``block`` round the ring; return the ``combine``d ``compute`` outputs of every rank
    on this rank's block (in rank order r, r+1, ..., r+K−1 for the accumulator).

    ``compute(block_in_hand)`` runs once per block (own first, then r−1, r−2, ...) and returns partials
    for that block's owner; partials travel behind the block (the travelling accumulator), so every
    transfer is in flight while a tile is computed. Called by all ranks of ``group`` with equal shapes.
    """
    k = D.get_world_size(group)
    held, own, acc = list(block), None, None
    for h in range(k):
        sends, cats = [], []
        if h < k - 1:  # the block in hand goes on to rank+1 for its next step
            sends, cats = list(held), list(block_cats)
        if h >= 2:  # the accumulator of the previous block follows it to rank+1
            sends, cats = sends + list(acc), cats + list(acc_cats)
        recv, wait = D.ring_shift(sends, cats, group, ledger) if sends else ([], lambda: None)
        part = compute(held)
        wait()
        if h == 0:
            own = part
        elif h == 1:  # this rank is the first foreign holder: the accumulator starts here
            acc = part
        else:
            acc = combine(recv[len(held) if h < k - 1 else 0 :], part)
        if h < k - 1:
            held = recv[: len(held)]
    if k == 1 or not own:  # no partials: nothing travels behind the blocks
        return own
    recv, wait = D.ring_shift(acc, acc_cats, group, ledger)  # last holder -> owner
    wait()
    return combine(own, recv)


def _logaddexp(a: Sequence[Tensor], b: Sequence[Tensor]) -> list[Tensor]:
    return [torch.logaddexp(u, v) for u, v in zip(a, b, strict=True)]


def _add(a: Sequence[Tensor], b: Sequence[Tensor]) -> list[Tensor]:
    return [u + v for u, v in zip(a, b, strict=True)]


class _RingLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, a, group, backend, ledger):
        row = None

        def tile(held: Sequence[Tensor]) -> list[Tensor]:
            nonlocal row
            part, col = K.lse_forward(x, held[0], a, a, backend=backend)
            row = part if row is None else torch.logaddexp(row, part)
            return [col]

        (col,) = circulate([y], [D.FEATURES], tile, _logaddexp, [D.SCALARS], group, ledger)
        pos = positive_logits(x, y)
        ctx.save_for_backward(x, y, a, row, col, pos)
        ctx.group, ctx.backend, ctx.ledger = group, backend, ledger
        return clip_value(row, col, a, pos)

    @staticmethod
    def backward(ctx, g):
        x, y, a, row, col, pos = ctx.saved_tensors
        b = x.shape[0]
        g = g.to(row.dtype)
        w = (g / (2 * b)).expand(b).contiguous()
        dx = torch.zeros(x.shape, dtype=row.dtype, device=x.device)
        da_row = torch.zeros((), dtype=row.dtype, device=x.device)

        def tile(held: Sequence[Tensor]) -> list[Tensor]:
            nonlocal dx, da_row
            ys, (col_s, w_s) = held[0], held[1]
            dxp, dyp, drow, dcol = K.lse_backward(x, ys, a, a, row, col_s, w, w_s, backend=ctx.backend)
            dx, da_row = dx + dxp, da_row + drow.sum()
            return [dyp, dcol.sum().reshape(1)]

        # The block carries its column LSEs and its owner's upstream weights: each rank's own g counts.
        dy, da_col = circulate(
            [y, torch.stack([col, w])],
            [D.FEATURES, D.SCALARS],
            tile,
            _add,
            [D.FEATURE_GRADS, D.SCALARS],
            ctx.group,
            ctx.ledger,
        )
        dx, dy = add_positive_grads(dx, dy, x, y, a, g)
        da = da_row + da_col[0] - g * pos.mean()
        return dx.to(x.dtype), dy.to(y.dtype), da.to(a.dtype), None, None, None


def ring_loss(x: Tensor, y: Tensor, a: Tensor, group=None, backend: str = "auto", ledger=None) -> Tensor:
    """Ring mode (module docstring). Called by all ranks of ``group``; sizes checked by the caller."""
    return _RingLoss.apply(x, y, a, group, backend, ledger)
