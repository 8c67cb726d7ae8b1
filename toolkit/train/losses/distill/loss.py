"""The distill objective (``--loss distill``): the CLIP loss plus a KL from a reference (teacher) model's
similarity distribution, as in MobileCLIP (arXiv 2311.17049), tiled (``kl``: no B×B matrix).

The teacher is the training set's reference model: its L2-normalised image and text embeddings of each
sample come with the batch (``reference=(ref_image, ref_text)``, precomputed with ``toolkit data precompute
--reference-model``), so no teacher runs during training. Per row i of the global batch (image→text) and
per column (text→image): KL(softmax(s^t_i·/τ_t) ‖ softmax(a·s_i·)), averaged over rows and columns and
halved, weighted λ against the CLIP loss's 1 − λ (``loss.distill``: ``DistillConfig``). The student's τ is
learnable as in the OpenCLIP baseline (``learn_tau``, ``tau_init``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from toolkit.core import dist as D
from toolkit.kernels import accumulation_dtype
from toolkit.train.losses.base import TrainingLoss, reference_rows
from toolkit.train.losses.config import LossConfig
from toolkit.train.losses.distill.kl import MODE_FNS
from toolkit.train.losses.modes.common import check_local_pair, checked_scale


class DistillLoss(TrainingLoss):
    """(1 − λ)·CLIP + λ·½(KL image→text + KL text→image) over the global batch (``TrainingLoss`` interface,
    ``reads_reference``; ``index`` unused). Modes: gather and fastclip (one process: either, same result)."""

    reads_reference = True

    def __init__(
        self,
        cfg: LossConfig | None = None,
        group=None,
        ledger: D.CommLedger | None = None,
        *,
        check_sizes: bool = True,
    ):
        super().__init__(cfg or LossConfig(kind="distill", mode="gather"), group, check_sizes=check_sizes)
        self.ledger = ledger

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor,
        index: Tensor | None = None,
        logit_bias: Tensor | None = None,
        reference: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        x, y = image_features, text_features
        check_local_pair(x, y, self.cfg.mode, tuple(MODE_FNS), "distill", self.cfg.backend)
        u, v = reference_rows(reference, x.shape[0], "distill")
        u, v = u.detach().to(device=x.device, dtype=x.dtype), v.detach().to(device=x.device, dtype=x.dtype)
        logit_scale = checked_scale(logit_scale, x, self.group, self.ledger, self.check_sizes)
        teacher_scale = torch.tensor(
            1.0 / self.cfg.distill.teacher_tau, dtype=accumulation_dtype(x), device=x.device
        )
        share = MODE_FNS[self.cfg.mode](
            x,
            y,
            logit_scale,
            u,
            v,
            teacher_scale,
            self.cfg.distill.weight,
            group=self.group,
            backend=self.cfg.backend,
            ledger=self.ledger,
        )
        self._last = share.detach()
        return share
