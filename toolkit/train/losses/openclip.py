"""The OpenCLIP baseline: the standard (mini-batch) CLIP loss with a learnable logit scale.

Single process: ``toolkit.kernels`` clip_loss. Under torch.distributed: the ``gather`` mode of
``toolkit.train.dist.contrastive_loss`` (OpenCLIP's ``local_loss`` + ``gather_with_grad``: this rank's
rows against the gathered global batch, features gathered with autograd), whose DDP-averaged gradient is
the gradient of the global-batch CLIP loss. The scale is a = exp(p); p is clamped to [0, ln 100] after
each optimiser step (``clamp_logit_scale_``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from toolkit.core import dist as cdist
from toolkit.kernels import clip_loss
from toolkit.train.dist import contrastive_loss
from toolkit.train.fastclip.schedules import MAX_LOGIT_SCALE


@torch.no_grad()
def clamp_logit_scale_(logit_scale: nn.Parameter, max_value: float = MAX_LOGIT_SCALE) -> None:
    """Clamp p in place to [0, max_value] (the reference does this after every optimiser step)."""
    logit_scale.clamp_(0.0, max_value)


class OpenCLIPLoss(nn.Module):
    """½(CE image→text + CE text→image) over the global batch; forward(x [b,d], y [b,d], a 0-d) -> 0-d.

    Called by every rank of ``group`` with the same b; ``backend`` is the kernels backend."""

    def __init__(self, group=None, backend: str = "auto"):
        super().__init__()
        self.group, self.backend = group, backend

    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: Tensor) -> Tensor:
        if cdist.get_world_size(self.group) == 1:  # one fused pass for both sides
            return clip_loss(image_features, text_features, logit_scale, backend=self.backend)
        return contrastive_loss(image_features, text_features, logit_scale, mode="gather", group=self.group,
                                backend=self.backend)
