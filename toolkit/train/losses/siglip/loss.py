"""``SigLIPLoss``: the sigmoid loss of SigLIP (arXiv 2303.15343) over the global batch, for the trainer.

−(1/B) Σ_i Σ_j log σ(z_ij (t·⟨x_i, y_j⟩ + b)) with t = exp(p) the model's logit scale (learnable, clamped
to [0, ln 100] like open_clip's) and b the model's learnable ``logit_bias``; both start at the config's
``loss.siglip.scale_init`` (10) and ``loss.siglip.bias_init`` (−10), the paper's initialisation, which the
trainer builds into the open_clip model (``init_logit_bias``), so checkpoints load in plain open_clip with the
bias. Distributed modes: ``siglip.modes`` (gather, ring, fastclip: no feature-gradient communication).
"""

from __future__ import annotations

from torch import Tensor

from toolkit.core import dist as cdist
from toolkit.train.losses.base import TrainingLoss
from toolkit.train.losses.config import LossConfig
from toolkit.train.losses.siglip.modes import sigmoid_loss


class SigLIPLoss(TrainingLoss):
    """The sigmoid loss (``TrainingLoss`` interface; ``index`` unused; ``logit_bias`` None counts as 0, as
    in open_clip's ``SigLipLoss``). Reports the bias as the metric ``logit_bias``."""

    def __init__(
        self,
        cfg: LossConfig | None = None,
        group=None,
        ledger: cdist.CommLedger | None = None,
        *,
        check_sizes: bool = True,
    ):
        super().__init__(cfg or LossConfig(kind="siglip", mode="gather"), group, check_sizes=check_sizes)
        self.ledger = ledger
        self._bias: Tensor | None = None

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor,
        index: Tensor | None = None,
        logit_bias: Tensor | None = None,
    ) -> Tensor:
        share = sigmoid_loss(
            image_features,
            text_features,
            logit_scale,
            logit_bias,
            mode=self.cfg.mode,
            group=self.group,
            backend=self.cfg.backend,
            ledger=self.ledger,
            check_sizes=self.check_sizes,
        )
        self._last = share.detach()
        self._bias = None if logit_bias is None else logit_bias.detach()
        return share

    def metrics(self) -> dict[str, float]:
        return {} if self._bias is None else {"logit_bias": float(self._bias)}
