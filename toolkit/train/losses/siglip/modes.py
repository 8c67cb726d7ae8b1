"""The global-batch sigmoid (SigLIP) loss across K ranks; entry point ``sigmoid_loss``.

Objective (K ranks, local batch b, global B = K·b, t = exp(p), bias b₀): with u_ij = t⟨x_i, y_j⟩ + b₀ over
the global batch and z_ij = +1 only for the B positive pairs, rank r's share is its rows' terms over every
column, divided by its local batch (open_clip's distributed ``SigLipLoss``):

    loss_r = −(1/b) Σ_{i ∈ rank r} Σ_{j < B} log σ(z_ij u_ij),     L = mean_r loss_r.

Gradient convention (``TrainingLoss``): rank r's backward gives K·∂L/∂(its features) and ∂loss_r/∂(t, b₀),
so DDP's mean is the one-process gradient on the concatenated batch. The tiles are independent (no
normaliser), which the modes use:

- ``gather``: one autograd all_gather of the text [b, d] -> [B, d]; rows x_r × all texts (positives at
  offset r·b); the gather's backward reduce-scatters dY [B, d] (each rank's own upstream gradient).
  (DisCo's refinement is already in it: only text is gathered, one reduce_scatter.)
- ``ring``: text blocks travel rank → rank+1 (K−1 hops, each posted before the tile it overlaps); the
  forward's one sweep per block gives this rank's loss, dx, dt, db and the block's dy partial, which
  travels behind the block as an fp32 accumulator and arrives complete at its owner (K−1 more hops).
  Nothing is communicated in the backward. Memory: tiles plus O(b·d).
- ``fastclip`` (no feature-gradient communication): one all_gather of the (image, text) pairs
  [b, 2, d] without autograd; rank r sweeps its rows x_r × Y (loss_r, dx_r, dt, db) and its columns
  y_r × X (dy_r: every rank's terms in its columns). It exists because ∂/∂s_ij depends on s_ij, t, b₀ only:
  no normaliser has to be exchanged (the CLIP loss needs its LSEs gathered; the sigmoid loss needs
  nothing). Cost: a second b×B sweep instead of any backward traffic.

``ring`` and ``fastclip`` form other ranks' gradient terms in the forward, with an upstream gradient of 1
scaled by this rank's own in the backward: scale the share only by factors equal on every rank (the
``TrainingLoss`` contract: a GradScaler's scale, 1/n). ``gather`` carries each rank's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from toolkit import kernels as K
from toolkit.core import dist as D
from toolkit.train.losses.modes.common import check_local_pair, gather_pairs
from toolkit.train.losses.modes.ring import circulate

MODES = ("gather", "ring", "fastclip")


def _sums(x, y, t, b0, offset, need_dx, need_dy, backend, compute_loss=True):
    return K.sigmoid_sums(
        x,
        y,
        t,
        b0,
        offset,
        compute_dx=need_dx,
        compute_dy=need_dy,
        compute_loss=compute_loss,
        backend=backend,
    )


def _finish(ctx, b: int, loss: Tensor, grads: list[Tensor | None], inputs: Sequence[Tensor]) -> Tensor:
    """Keep the forward's gradients (None where not needed) for the backward; the share loss/b."""
    need = ctx.needs_input_grad
    ctx.grads = [g if n else None for g, n in zip(grads, need, strict=False)]
    ctx.dtypes, ctx.rows = [t.dtype for t in inputs], b
    return loss / b


def _scaled_grads(ctx, grad: Tensor) -> list[Tensor | None]:
    """The forward's gradients times upstream/b, in each input's dtype (ctx's references dropped first)."""
    grads, ctx.grads = ctx.grads, None
    return [
        None if g is None else g.mul_(grad.to(g.dtype) / ctx.rows).to(dt)
        for g, dt in zip(grads, ctx.dtypes, strict=True)
    ]


class _RingSigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, t, b0, group, backend, ledger):
        need = ctx.needs_input_grad
        need_x, need_y = need[0] or need[2] or need[3], need[1]
        acc = K.accumulation_dtype(x)
        zero = torch.zeros((), dtype=acc, device=x.device)
        mine = {
            "loss": zero,
            "dx": None,
            "dt": zero,
            "db": zero,
            "blocks": 0,
        }  # this rank's rows, every block

        def tile(held: Sequence[Tensor]) -> list[Tensor]:
            # circulate hands the own block first: its diagonal holds the positives; the others have none
            out = _sums(x, held[0], t, b0, None if mine["blocks"] else 0, need_x, need_y, backend)
            mine["blocks"] += 1
            mine["loss"] = mine["loss"] + out.loss
            if need_x:
                mine["dx"] = out.dx if mine["dx"] is None else mine["dx"].add_(out.dx)
                mine["dt"], mine["db"] = mine["dt"] + out.d_scale, mine["db"] + out.d_bias
            return [out.dy] if need_y else []  # the block's dy partial travels on to its owner

        parts = circulate(
            [y],
            [D.FEATURES],
            tile,
            lambda a, c: [u + v for u, v in zip(a, c, strict=True)],
            [D.FEATURE_GRADS] if need_y else [],
            group,
            ledger,
        )
        return _finish(
            ctx,
            x.shape[0],
            mine["loss"],
            [mine["dx"], parts[0] if need_y else None, mine["dt"], mine["db"]],
            (x, y, t, b0),
        )

    @staticmethod
    def backward(ctx, grad):
        return (*_scaled_grads(ctx, grad), None, None, None)


class _AnchorSigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, t, b0, group, backend, ledger):
        need = ctx.needs_input_grad
        r, b = D.get_rank(group), x.shape[0]
        xs, ys = gather_pairs(x, y, group, ledger=ledger)
        rows = _sums(x, ys, t, b0, r * b, need[0] or need[2] or need[3], False, backend)
        # y_r's gradient: every rank's rows against this rank's texts, swept as y_r × X (positives at r·b)
        dy = _sums(y, xs, t, b0, r * b, True, False, backend, compute_loss=False).dx if need[1] else None
        return _finish(ctx, b, rows.loss, [rows.dx, dy, rows.d_scale, rows.d_bias], (x, y, t, b0))

    @staticmethod
    def backward(ctx, grad):
        return (*_scaled_grads(ctx, grad), None, None, None)


def gather_sigmoid(
    x: Tensor, y: Tensor, t: Tensor, b0: Tensor, group=None, backend: str = "auto", ledger=None
) -> Tensor:
    """Gather mode (module docstring). Called by all ranks of ``group``; sizes checked by the caller."""
    ys = D.all_gather_with_grad(y, group, check_sizes=False, ledger=ledger)
    return K.SigLIPLossFn.apply(x, ys, t, b0, D.get_rank(group) * x.shape[0], x.shape[0], backend, None, None)


def ring_sigmoid(
    x: Tensor, y: Tensor, t: Tensor, b0: Tensor, group=None, backend: str = "auto", ledger=None
) -> Tensor:
    """Ring mode (module docstring). Called by all ranks of ``group``; sizes checked by the caller."""
    return _RingSigmoid.apply(x, y, t, b0, group, backend, ledger)


def anchor_sigmoid(
    x: Tensor, y: Tensor, t: Tensor, b0: Tensor, group=None, backend: str = "auto", ledger=None
) -> Tensor:
    """The fastclip mode (module docstring). Called by all ranks of ``group``; sizes checked by the caller."""
    return _AnchorSigmoid.apply(x, y, t, b0, group, backend, ledger)


MODE_FNS = {"gather": gather_sigmoid, "ring": ring_sigmoid, "fastclip": anchor_sigmoid}


def sigmoid_loss(
    image_local: Tensor,
    text_local: Tensor,
    scale: Tensor | float,
    bias: Tensor | float | None,
    *,
    mode: str,
    group=None,
    backend: str = "auto",
    ledger: D.CommLedger | None = None,
    check_sizes: bool = True,
) -> Tensor:
    """This rank's share loss_r (0-d; fp32, fp64 for fp64 features) of the global-batch sigmoid loss.

    image_local, text_local [b, d] (same b on every rank, checked unless ``check_sizes`` is False);
    ``scale`` t (0-d, t itself), ``bias`` b₀ (0-d; None = 0); ``mode`` one of ``MODES``. Called by every
    rank of ``group`` (default: world); without a process group (or K = 1) every mode is the one-process
    loss, ``toolkit.kernels.siglip_loss``.
    """
    check_local_pair(image_local, text_local, mode, MODES, "sigmoid-loss", backend)  # before any collective
    t = scale if isinstance(scale, Tensor) else torch.tensor(float(scale), device=image_local.device)
    b0 = (
        torch.zeros((), device=image_local.device)
        if bias is None
        else (bias if isinstance(bias, Tensor) else torch.tensor(float(bias), device=image_local.device))
    )
    for name, v in (("scale", t), ("bias", b0)):
        if v.numel() != 1:
            raise ValueError(f"{name} must be 0-d, got shape {tuple(v.shape)}")
    t, b0 = t.reshape(()), b0.reshape(())
    if D.get_world_size(group) == 1:
        return K.siglip_loss(image_local, text_local, t, b0, backend=backend)
    if check_sizes:
        D.check_equal_sizes(image_local, group, what="local batch (image/text features)", ledger=ledger)
    return MODE_FNS[mode](image_local, text_local, t, b0, group=group, backend=backend, ledger=ledger)
