"""The distill objective's own settings: ``DistillConfig``, the ``loss.distill`` section of ``LossConfig``
(torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.core.config import option


@dataclass(frozen=True)
class DistillConfig:
    """MobileCLIP's distillation (arXiv 2311.17049): (1 − weight)·CLIP loss + weight·½(KL image→text + KL
    text→image) between the teacher's and the student's softmax over each row (column) of the batch's
    similarities (docs/objectives.md)."""

    weight: float = option(
        0.5,
        ge=0,
        le=1,
        doc="λ: the loss is (1 − λ)·CLIP loss + λ·KL(teacher ‖ student); "
        "1: distillation only, 0: the plain CLIP loss.",
    )
    teacher_tau: float = option(
        0.01,
        gt=0,
        doc="Temperature τ_t of the teacher's softmax (its logits are "
        "s/τ_t): the reference model's own τ (trained open_clip models "
        "sit at the clamp 0.01, a logit scale of 100).",
    )
