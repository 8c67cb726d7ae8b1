"""The OpenCLIP baseline: the standard (mini-batch) CLIP loss with a learnable logit scale.

Single process: ``toolkit.kernels`` clip_loss. Under torch.distributed: OpenCLIP's ``local_loss`` +
``gather_with_grad`` formulation (this rank's rows against the gathered global batch, features gathered
with autograd), whose DDP-averaged gradient is the gradient of the global-batch CLIP loss. The scale is
a = exp(p); p is clamped to [0, ln 100] after each optimiser step (``clamp_logit_scale_``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from toolkit.core import dist as cdist

try:
    from toolkit.kernels import clip_loss as _clip_loss
except ImportError:  # before backend dispatch lands
    from toolkit.kernels.naive import clip_loss as _clip_loss

MAX_LOGIT_SCALE = math.log(100.0)


@torch.no_grad()
def clamp_logit_scale_(logit_scale: nn.Parameter, max_value: float = MAX_LOGIT_SCALE) -> None:
    """Clamp p in place to [0, max_value] (the reference does this after every optimiser step)."""
    logit_scale.clamp_(0.0, max_value)


def _gather_with_grad(t: Tensor, group) -> Tensor:
    try:
        from toolkit.core.dist import all_gather_with_grad
    except ImportError:
        from torch.distributed.nn.functional import all_gather

        return torch.cat(all_gather(t, group=group), 0)
    return all_gather_with_grad(t, group=group)


class OpenCLIPLoss(nn.Module):
    """½(CE image→text + CE text→image) over the global batch; forward(x [b,d], y [b,d], a) -> 0-d."""

    def __init__(self, group=None):
        super().__init__()
        self.group = group

    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: Tensor) -> Tensor:
        rank, k = cdist.get_rank(self.group), cdist.get_world_size(self.group)
        if k == 1:
            return _clip_loss(image_features, text_features, logit_scale)
        xg = _gather_with_grad(image_features, self.group)
        yg = _gather_with_grad(text_features, self.group)
        b = image_features.shape[0]
        labels = torch.arange(b, device=image_features.device) + rank * b
        logits_i = logit_scale * image_features @ yg.T
        logits_t = logit_scale * text_features @ xg.T
        return 0.5 * (F.cross_entropy(logits_i, labels) + F.cross_entropy(logits_t, labels))
