"""SigLIP's registry entry: ``--loss siglip``, the gather, ring and fastclip modes (no disco), the model's
learnable logit bias and scale initialised from its own settings, and its feature traffic."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from toolkit.train.losses.spec import F32, F64, ObjectiveSpec, Traffic


def siglip_traffic(
    mode: str, world: int, b: int, d: int, feature_bytes: int = 4, fields: Mapping[str, Any] | None = None
) -> Traffic:
    """The sigmoid loss's feature traffic per rank (toolkit/train/losses/siglip/modes.py): gather moves the
    texts only (one all_gather, one reduce_scatter of [B, d]); ring K−1 text hops and K−1 hops of dy
    partials in the accumulation dtype (fp32; fp64 for fp64 features), all in the forward; fastclip one
    all_gather of the pairs and no gradient traffic (no normaliser to exchange either)."""
    k, acc_bytes = world, F64 if feature_bytes == F64 else F32
    if mode == "gather":
        return {
            ("all_gather", "features"): (1, b * d * feature_bytes),
            ("reduce_scatter", "feature_grads"): (1, k * b * d * feature_bytes),
        }
    if mode == "ring":
        out: Traffic = {}
        for op in ("send", "recv"):
            out |= {
                (op, "features"): (k - 1, (k - 1) * b * d * feature_bytes),
                (op, "feature_grads"): (k - 1, (k - 1) * b * d * acc_bytes),
            }
        return out
    if mode == "fastclip":
        return {("all_gather", "features"): (1, 2 * b * d * feature_bytes)}
    raise ValueError(f"the siglip objective runs in the gather, ring or fastclip mode, not {mode!r}")


SPEC = ObjectiveSpec(
    kind="siglip",
    title="SigLIP",
    target="toolkit.train.losses.siglip.loss:SigLIPLoss",
    modes=("gather", "ring", "fastclip"),
    modes_note="its gather mode already gathers only the texts and reduce-scatters their gradients once. Use "
    "mode gather, ring or fastclip",
    traffic=siglip_traffic,
    init_logit_bias=lambda cfg: cfg.siglip.bias_init,
    initial_tau=lambda cfg: 1.0 / cfg.siglip.scale_init,
)
