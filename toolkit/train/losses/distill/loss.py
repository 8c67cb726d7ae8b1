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
from toolkit.train.losses.base import TrainingLoss
from toolkit.train.losses.config import LossConfig
from toolkit.train.losses.distill.kl import MODE_FNS


class DistillLoss(TrainingLoss):
    """(1 − λ)·CLIP + λ·½(KL image→text + KL text→image) over the global batch (``TrainingLoss`` interface,
    ``reads_reference``; ``index`` unused). Modes: gather and fastclip (one process: either, same result)."""

    reads_reference = True

    def __init__(self, cfg: LossConfig | None = None, group=None, ledger: D.CommLedger | None = None, *,
                 check_sizes: bool = True):
        super().__init__(cfg or LossConfig(kind="distill", mode="gather"), group, check_sizes=check_sizes)
        self.ledger = ledger

    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: Tensor,
                index: Tensor | None = None, logit_bias: Tensor | None = None,
                reference: tuple[Tensor, Tensor] | None = None) -> Tensor:
        x, y = image_features, text_features
        u, v = self._teacher(x, y, reference)
        if not isinstance(logit_scale, Tensor):
            logit_scale = torch.tensor(float(logit_scale), device=x.device)
        if logit_scale.dim() != 0:
            raise ValueError(f"logit_scale must be 0-d, got shape {tuple(logit_scale.shape)}")
        if self.check_sizes and D.get_world_size(self.group) > 1:
            D.check_equal_sizes(x, self.group, what="local batch (image/text features)", ledger=self.ledger)
        teacher_scale = torch.tensor(1.0 / self.cfg.distill.teacher_tau, dtype=accumulation_dtype(x), device=x.device)
        share = MODE_FNS[self.cfg.mode](x, y, logit_scale, u, v, teacher_scale, self.cfg.distill.weight,
                                        group=self.group, backend=self.cfg.backend, ledger=self.ledger)
        self._last = share.detach()
        return share

    @staticmethod
    def _teacher(x: Tensor, y: Tensor, reference: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
        """The reference rows (ref_image, ref_text) [b, d_ref], checked against x, y [b, d], in x's dtype."""
        if reference is None:
            raise ValueError("the distill objective needs reference=(ref_image, ref_text): a reference model's "
                             "embeddings of the batch (a training set precomputed with --reference-model)")
        if x.dim() != 2 or x.shape != y.shape:
            raise ValueError(f"image_features {tuple(x.shape)} and text_features {tuple(y.shape)} must both be "
                             "[b, d] with the same shape")
        u, v = reference
        if u.dim() != 2 or u.shape != v.shape or u.shape[0] != x.shape[0]:
            raise ValueError(f"reference embeddings ref_image {tuple(u.shape)} and ref_text {tuple(v.shape)} must "
                             f"both be [b, d_ref] with b = {x.shape[0]} (the batch's rows)")
        return u.detach().to(device=x.device, dtype=x.dtype), v.detach().to(device=x.device, dtype=x.dtype)
