"""The distill objective's registry entry: ``--loss distill``, the gather and fastclip modes (disco and ring
are not written for it), the CLIP loss's feature traffic plus the reference embeddings'."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from toolkit.train.losses.spec import F32, F64, ObjectiveSpec, Traffic


def distill_traffic(
    mode: str, world: int, b: int, d: int, feature_bytes: int = 4, fields: Mapping[str, Any] | None = None
) -> Traffic:
    """Feature traffic per rank per step (losses/distill/kl.py), the teacher's width d_ref taken equal to d
    (the plan does not know the reference model): gather: the student's x and y all_gathered with autograd
    (their [B, d] gradients reduce-scattered) and the teacher pairs [b, 2, d_ref] without; fastclip: the
    student and teacher pairs all_gathered without autograd and 4 LSEs per sample (fp32; fp64 for fp64
    features), no gradient traffic."""
    big_b, acc_bytes = world * b, F64 if feature_bytes == F64 else F32  # the LSEs: the accumulation dtype
    if mode == "gather":
        return {
            ("all_gather", "features"): (3, 4 * b * d * feature_bytes),
            ("reduce_scatter", "feature_grads"): (2, 2 * big_b * d * feature_bytes),
        }
    if mode == "fastclip":
        return {
            ("all_gather", "features"): (2, 4 * b * d * feature_bytes),
            ("all_gather", "scalars"): (1, 4 * b * acc_bytes),
        }
    raise ValueError(f"the distill objective runs in the gather or fastclip mode, not {mode!r}")


SPEC = ObjectiveSpec(
    kind="distill",
    title="distillation (from a reference model)",
    target="toolkit.train.losses.distill.loss:DistillLoss",
    modes=("gather", "fastclip"),
    modes_note="its KL is written for the gather mode (OpenCLIP's) and the fastclip mode (no "
    "feature-gradient "
    "communication); use mode gather or fastclip",
    traffic=distill_traffic,
)
