"""DRRho-CLIP's registry entry: ``--loss drrho``, the fastclip mode only (FastCLIP's step on features widened
by the reference's), FastCLIP v3's host tables (u1, u2) and the traffic of its widened feature gather."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from toolkit.train.losses.spec import F64, ObjectiveSpec, Traffic

SCALAR_COLUMNS = 5  # ids, log u1, log u2, log g1, log g2: FastCLIP v3's (fastclip/spec.py)


def table_columns(fields: Mapping[str, Any]) -> int:
    """float32 columns per sample in the host tables: u1, u2 (FastCLIP v3's)."""
    return 2


def traffic(mode: str, world: int, b: int, d: int, feature_bytes: int, fields: Mapping[str, Any]) -> Traffic:
    """One all_gather of the widened pairs [b, 2, d + d_ref] and one of the per-sample scalars; no
    feature-gradient traffic. The widened rows are in the promoted dtype of the features and the reference's;
    this counts ``feature_bytes`` an element, i.e. a reference delivered in the run's feature dtype (a float32
    reference with bf16 features gathers 4 bytes an element). d_ref is ``fields["ref_dim"]``, else taken equal
    to d."""
    width = d + int(fields.get("ref_dim", d))
    return {
        ("all_gather", "features"): (1, 2 * b * width * feature_bytes),
        ("all_gather", "scalars"): (1, b * SCALAR_COLUMNS * F64),
    }


SPEC = ObjectiveSpec(
    kind="drrho",
    title="DRRho-CLIP (from a reference model)",
    target="toolkit.train.losses.drrho.loss:DRRhoLoss",
    modes=("fastclip",),
    modes_note="it is FastCLIP's step (no feature-gradient communication). Use mode: fastclip",
    table_columns=table_columns,
    traffic=traffic,
    learns_logit_scale=lambda cfg: cfg.learn_tau,
)
