"""The OpenCLIP baseline: the standard CLIP loss over the global batch, in any distributed mode.

One process: ``toolkit.kernels.clip_loss`` (both LSEs in one fused tiled pass). K ranks: the configured
mode of ``contrastive_loss`` (gather = OpenCLIP's ``local_loss`` + ``gather_with_grad``; disco, ring,
fastclip give the same gradients with less communication or memory). τ is learnable (``learn_tau``,
clamped to [0, ln 100] by the trainer's ``TemperatureControl``) or fixed at ``tau_init``.
"""

from __future__ import annotations

from torch import Tensor

from toolkit.core import dist as cdist
from toolkit.kernels import clip_loss
from toolkit.train.losses.base import TrainingLoss
from toolkit.train.losses.config import LossConfig
from toolkit.train.losses.modes import contrastive_loss


class OpenCLIPLoss(TrainingLoss):
    """½(CE image→text + CE text→image) over the global batch (``TrainingLoss`` interface; ``index``
    unused)."""

    def __init__(
        self,
        cfg: LossConfig | None = None,
        group=None,
        ledger: cdist.CommLedger | None = None,
        *,
        check_sizes: bool = True,
    ):
        super().__init__(cfg or LossConfig(kind="openclip", mode="gather"), group, check_sizes=check_sizes)
        self.ledger = ledger

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor,
        index: Tensor | None = None,
        logit_bias: Tensor | None = None,
    ) -> Tensor:
        if cdist.get_world_size(self.group) == 1:
            share = clip_loss(image_features, text_features, logit_scale, backend=self.cfg.backend)
        else:
            share = contrastive_loss(
                image_features,
                text_features,
                logit_scale,
                mode=self.cfg.mode,
                group=self.group,
                backend=self.cfg.backend,
                ledger=self.ledger,
                check_sizes=self.check_sizes,
            )
        self._last = share.detach()
        return share
