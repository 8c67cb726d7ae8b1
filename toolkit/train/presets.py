"""Published training settings as ready-made configs: ``Preset``, and ``presets()`` gathered from the
objectives.

A preset is a whole training setting, not just a loss: model, global batch, epochs, optimiser with its
schedule, and the objective. Its ``model``, ``batch_size``, ``epochs``, ``train_num_samples``, ``loss``
(a ``LossConfig``) and ``optim`` (an ``OptimConfig``) carry the same names and types as the trainer's
config, so ``train_overrides()`` applies them without renaming anything; the other fields say where
the setting comes from. Batch sizes are global (GPUs × per-GPU batch of the reference scripts). Fields
the reference does not publish for a setting are None (set them for your run).

Each objective keeps its presets in its folder (``losses/NAME/presets.py``, named by its spec's ``presets``);
``presets()`` gathers them in the registry's order when called, so an objective registered later counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from toolkit.core.config import build, option, to_dict
from toolkit.train.losses import registry
from toolkit.train.losses.config import LossConfig
from toolkit.train.optim import OptimConfig


@dataclass(frozen=True)
class Preset:
    """One published training setting."""

    description: str = option(doc="What the setting is and where it comes from.")
    dataset: str = option(doc="Training set of the reference run.")
    reference_layout: str = option("", doc="GPUs x per-GPU batch in the reference script.")
    data_size: int | None = option(
        None, doc="Samples (ids) of the reference's training set (None: not published)."
    )
    model: str = option("RN50", doc="open_clip model name of the reference run.")
    batch_size: int = option(1024, ge=1, doc="Global batch: pairs per step over all ranks.")
    epochs: int | None = option(None, doc="Training epochs (None: not published).")
    train_num_samples: int | None = option(None, doc="Samples per (virtual) epoch in the reference run.")
    loss: LossConfig = option(factory=LossConfig, doc="The objective.")
    optim: OptimConfig = option(factory=OptimConfig, doc="The model optimiser and its schedule.")

    def train_overrides(self) -> dict[str, Any]:
        """The trainer-config keys this preset sets (None values left out), as plain data."""
        keys = ("model", "batch_size", "epochs", "train_num_samples", "loss", "optim")
        data = to_dict(self)
        return {k: data[k] for k in keys if data[k] is not None}


def presets() -> dict[str, Preset]:
    """Every registered objective's presets (registry order), built and checked; a name two objectives
    use is refused."""
    found: dict[str, Preset] = {}
    for kind, spec in registry.specs().items():
        for name, data in spec.presets.items():
            if name in found:
                raise ValueError(
                    f"preset {name!r} of objective {kind!r} is already defined by another objective"
                )
            found[name] = build(Preset, data, source=f"the {kind} objective's presets", prefix=name)
    return found


def get_preset(name: str) -> Preset:
    """The preset called ``name``; a clear error listing the known ones otherwise."""
    known = presets()
    if name not in known:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(known)}")
    return known[name]
