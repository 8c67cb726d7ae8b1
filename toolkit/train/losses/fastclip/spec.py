"""FastCLIP's registry entry: ``--loss fastclip-v0`` … ``fastclip-v3``, the fastclip mode only, per-sample
host tables (u1, u2; v2 adds τ, bound, m, v per side), the scalars its step all_gathers, and the reference's
published settings (``presets.py``). Its settings: ``config.py`` (the ``loss.fastclip`` section)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from toolkit.train.losses.fastclip.presets import PRESETS
from toolkit.train.losses.spec import F64, ObjectiveSpec, Traffic

VERSIONS = ("v0", "v1", "v2", "v3")


def scalar_columns(version: str) -> int:
    """Per-sample float64 columns FastCLIP's objective all_gathers per step: ids, log u1, log u2, log g1,
    log g2 (v0, v1, v3); v2 adds τ, bound, m, v per side (fastclip/loss.py, fastclip/individual.py)."""
    return 13 if version == "v2" else 5


def _version(fields: Mapping[str, Any]) -> str:
    """The version a (sectioned) LossConfig mapping sets, v3 by default."""
    section = fields.get("fastclip")
    return section.get("version", "v3") if isinstance(section, Mapping) else "v3"


def table_columns(fields: Mapping[str, Any]) -> int:
    """float32 columns per sample in the host tables: u1, u2; v2 also τ, bound, m, v per side."""
    return 10 if _version(fields) == "v2" else 2


def traffic(mode: str, world: int, b: int, d: int, feature_bytes: int, fields: Mapping[str, Any]) -> Traffic:
    """One all_gather of the pairs and one of the per-sample scalars; no feature-gradient traffic."""
    return {
        ("all_gather", "features"): (1, 2 * b * d * feature_bytes),
        ("all_gather", "scalars"): (1, b * scalar_columns(_version(fields)) * F64),
    }


SPEC = ObjectiveSpec(
    kind="fastclip",
    title="FastCLIP",
    target="toolkit.train.losses.fastclip.loss:FastCLIPLoss",
    names={f"fastclip-{v}": {"fastclip": {"version": v}} for v in VERSIONS},
    modes=("fastclip",),
    modes_note="its step needs no feature-gradient communication. Use mode: fastclip, or kind: openclip for "
    "gather/disco/ring",
    table_columns=table_columns,
    traffic=traffic,
    learns_logit_scale=lambda cfg: cfg.fastclip.version in ("v0", "v3"),
    presets=PRESETS,
)
