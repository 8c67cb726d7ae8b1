"""The objective ``toolkit train`` uses when none is named (torch-free: config building calls it).

One objective at every global batch and epoch count, with one knob that scales with the run: FastCLIP-v3
with the batch drift correction of its estimators (``u_drift: batch``), γ decaying from 1 to γ_min over
all the planned epochs, and its learned τ kept at or above 0.03 (``tau_floor``: the smallest τ validation
picked for the fixed-τ OpenCLIP in any measured cell; without it τ falls at every step, to the 0.01 clamp
in long runs at small batches). The evidence, every measured cell of both benchmarks (docs/objectives.md, "Which
objective to pick", lists each cell's Δ against the best-tuned OpenCLIP):

- benchmarks/objectives/results/scratch.md: towers trained from random init on Unicode glyphs, the data set
  ~110–435× the batch;
- benchmarks/objectives/results/convergence_default.md: LiT heads on frozen towers over emoji drawings;
- the floor: convergence_tau_floor.md (LiT), scratch_floor_*.md and scratch_default_long_b32_3seeds.md.

An explicit ``--loss`` / ``loss.kind`` or a ``--preset`` always wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DEFAULT_LOSS: dict[str, Any] = {
    "kind": "fastclip",
    "tau_floor": 0.03,
    "fastclip": {"version": "v3", "u_drift": "batch"},
}


def default_loss(epochs: int | None = None, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``LossConfig`` fields (sectioned) of the default objective for a run of ``epochs`` planned epochs
    (None: a run planned by steps, whose epoch count is unknown when the config is built: γ keeps the
    option's own decay, ``FastCLIPConfig.gamma_decay_epochs``). ``given``: the loss keys the user set
    without naming a kind; an explicit γ decay or DRRho's γ rule among them (it plans its own decay over the
    epochs) is left alone."""
    given = given or {}
    section = given.get("fastclip") if isinstance(given.get("fastclip"), Mapping) else {}
    fields = {**DEFAULT_LOSS, "fastclip": dict(DEFAULT_LOSS["fastclip"])}
    own_decay = "gamma_decay_epochs" in section or section.get("gamma_rule") == "drrho"
    if epochs is not None and epochs >= 1 and not own_decay:
        fields["fastclip"]["gamma_decay_epochs"] = int(epochs)
    return fields


def describe() -> str:
    """One line for --help and docs."""
    return (
        "fastclip-v3 (u_drift: batch), γ decaying over all the planned epochs, τ kept >= 0.03,"
        " at every batch size"
    )
