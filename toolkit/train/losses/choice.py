"""The objective ``toolkit train`` uses when none is named, layered under the user's config (torch-free:
config building calls it).

One objective at every global batch and epoch count, with one knob that scales with the run: FastCLIP-v3
with the batch drift correction of its estimators (``u_drift: batch``), γ decaying from 1 to γ_min over
all the planned epochs, and its learned τ kept at or above 0.03 (``tau_floor``: the smallest τ validation
picked for the fixed-τ OpenCLIP in any measured cell; without it τ falls at every step, to the 0.01 clamp
in long runs at small batches). The evidence, every measured cell of both benchmarks (docs/objectives.md,
"Which objective to pick", lists each cell's Δ against the best-tuned OpenCLIP):

- benchmarks/objectives/results/scratch.md: towers trained from random init on Unicode glyphs, the data set
  ~110–435× the batch;
- benchmarks/objectives/results/convergence_default.md: LiT heads on frozen towers over emoji drawings;
- the floor: convergence_tau_floor.md (LiT), scratch_floor_*.md and scratch_default_long_b32_3seeds.md.

An explicit ``--loss`` / ``loss.kind`` or a ``--preset`` always wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from toolkit.core.config import ConfigError, deep_merge

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
    epochs) is left alone, and a given initial τ below the floor lowers the floor to it (a floor above it
    would raise the user's τ at the first step)."""
    given = given or {}
    section = given.get("fastclip") if isinstance(given.get("fastclip"), Mapping) else {}
    fields = {**DEFAULT_LOSS, "fastclip": dict(DEFAULT_LOSS["fastclip"])}
    own_decay = "gamma_decay_epochs" in section or section.get("gamma_rule") == "drrho"
    if epochs is not None and epochs >= 1 and not own_decay:
        fields["fastclip"]["gamma_decay_epochs"] = int(epochs)
    tau_init = given.get("tau_init")
    if "tau_floor" not in given and isinstance(tau_init, (int, float)) and 0 < tau_init < fields["tau_floor"]:
        fields["tau_floor"] = float(tau_init)
    return fields


def layer_default_loss(data: Mapping[str, Any], layers: dict[str, Any], epochs: Any, source: str) -> None:
    """Put the default objective into ``layers["loss"]`` (the defaults under the user's config: a preset's
    settings) where neither ``data`` (the user's config) nor the preset names a loss kind, then DRRho's γ
    decay over the planned epochs. ``epochs``: the run's planned epochs, None for a run planned by steps."""
    given = data.get("loss") if isinstance(data.get("loss"), Mapping) else {}
    loss = deep_merge(layers.get("loss", {}), given)
    if "kind" not in loss:
        try:
            chosen = default_loss(None if epochs is None else int(epochs), loss)
        except (TypeError, ValueError):
            chosen = None  # a malformed epochs: build() reports it against its key
        if chosen is not None:
            layers["loss"] = deep_merge(layers.get("loss", {}), chosen)
    _plan_drrho_gamma(data, layers, epochs, source)


def _fastclip_section(layer: Mapping[str, Any]) -> Mapping[str, Any]:
    """``loss.fastclip`` of one layer of config data, {} where it gives none."""
    loss = layer.get("loss")
    section = loss.get("fastclip") if isinstance(loss, Mapping) else None
    return section if isinstance(section, Mapping) else {}


def _plan_drrho_gamma(data: Mapping[str, Any], layers: dict[str, Any], epochs: Any, source: str) -> None:
    """``loss.fastclip.gamma_rule: drrho`` decays γ over the run's planned epochs E (DRRho-CLIP's README: set
    gamma_decay_epochs to the epochs): fill ``loss.fastclip.gamma_decay_epochs`` with ``epochs`` unless it is
    given. ``epochs``: the run's planned epochs, None for a run planned by ``steps``, which has no epoch count
    before the data is read and so must give the value itself."""
    fastclip = {**_fastclip_section(layers), **_fastclip_section(data)}
    if fastclip.get("gamma_rule") != "drrho" or "gamma_decay_epochs" in fastclip:
        return
    if epochs is None:
        raise ConfigError(
            source,
            "loss.fastclip.gamma_decay_epochs",
            "gamma_rule: drrho needs the planned epochs; a run set by steps must give "
            "loss.fastclip.gamma_decay_epochs",
        )
    loss = layers.get("loss", {})
    layers["loss"] = {**loss, "fastclip": {**loss.get("fastclip", {}), "gamma_decay_epochs": epochs}}


def describe() -> str:
    """One line for --help and docs."""
    return (
        "fastclip-v3 (u_drift: batch), γ decaying over all the planned epochs, "
        f"τ kept >= {DEFAULT_LOSS['tau_floor']:g}, at every batch size"
    )
