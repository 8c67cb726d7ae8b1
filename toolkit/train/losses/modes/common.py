"""What the distributed modes, the ring and FastCLIP's anchors share (a leaf: imports kernels and core only).

Notation (docs/architecture.md): K ranks, local batch b, global batch B = K·b; x, y [b, d] this rank's
L2-normalised image and text rows; a = exp(p) the logit scale.
"""

from __future__ import annotations

import torch
from torch import Tensor

from toolkit import kernels as K
from toolkit.core import dist as D
from toolkit.kernels import accumulation_dtype, clip_value

__all__ = [
    "accumulation_dtype",
    "add_positive_grads",
    "check_local_pair",
    "checked_scale",
    "clip_value",
    "gather_pairs",
    "positive_logits",
]


def positive_logits(x: Tensor, y: Tensor) -> Tensor:
    """s_ii = <x_i, y_i> [b] in the accumulation dtype (fp32, fp64 for fp64 inputs), no autograd."""
    acc = accumulation_dtype(x)
    return (x.detach().to(acc) * y.detach().to(acc)).sum(1)


def add_positive_grads(
    dx: Tensor, dy: Tensor, x: Tensor, y: Tensor, a: Tensor, g: Tensor
) -> tuple[Tensor, Tensor]:
    """Add the gradients of −a·mean_i(x_i·y_i) (upstream ``g``, 0-d) to the local dx, dy [b, d]."""
    c = g * a.detach().to(g.dtype) / x.shape[0]
    return dx - c * y.to(g.dtype), dy - c * x.to(g.dtype)


def gather_pairs(
    x: Tensor, y: Tensor, group=None, check_sizes: bool = False, ledger=None
) -> tuple[Tensor, Tensor]:
    """All ranks' (image, text) rows without autograd: ONE all_gather of the stacked [b, 2, d] (category
    ``features``, in the promoted feature dtype) -> contiguous X [B, d], Y [B, d] in rank order.

    Called by all ranks of ``group``; ``check_sizes`` refuses unequal batches (callers that checked skip
    it)."""
    pairs = D.all_gather_nograd(
        torch.stack([x.detach(), y.detach()], 1), group, D.FEATURES, check_sizes=check_sizes, ledger=ledger
    )
    return pairs[:, 0].contiguous(), pairs[:, 1].contiguous()


def check_local_pair(
    image_local: Tensor, text_local: Tensor, mode: str, modes: tuple[str, ...], what: str, backend: str
) -> None:
    """Refuse, before any collective, an unknown ``mode`` (of ``modes``; ``what`` names the loss: "loss",
    "sigmoid-loss"), features that are not both [b, d] of one shape, and an unknown kernels ``backend``."""
    if mode not in modes:
        raise ValueError(f"unknown distributed {what} mode {mode!r}; choose one of {modes}")
    if image_local.dim() != 2 or image_local.shape != text_local.shape:
        raise ValueError(
            f"image_local {tuple(image_local.shape)} and text_local {tuple(text_local.shape)} "
            "must both be [b, d] with the same shape"
        )
    K.resolve_backend(backend, image_local.device)


def checked_scale(
    logit_scale: Tensor | float,
    image_local: Tensor,
    group=None,
    ledger: D.CommLedger | None = None,
    check_sizes: bool = True,
) -> Tensor:
    """The logit scale a as a 0-d tensor (a float becomes one on image_local's device; any other shape is
    refused); with ``check_sizes``, also refuses local batches image_local [b, d] of different shapes across
    the ranks of ``group`` (one tiny all_gather when K > 1). Called by every rank, after
    ``check_local_pair``."""
    logit_scale = K.as_scale(logit_scale, image_local.device)
    if check_sizes:
        D.check_equal_sizes(image_local, group, what="local batch (image/text features)", ledger=ledger)
    return logit_scale
