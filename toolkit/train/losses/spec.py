"""``ObjectiveSpec``: what the trainer, the CLI and ``toolkit plan`` need to know about one objective, held in
the objective's own folder (``losses/NAME/spec.py``) and listed by ``losses/registry.py``. Torch-free: the
CLI validates ``--loss`` and ``toolkit plan`` runs its arithmetic without importing torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# The CLIP loss's distributed modes (losses/modes/); an objective names the ones it runs in.
CLIP_MODES = ("gather", "disco", "ring", "fastclip")
# {(op, category): (calls or None, bytes)} per rank per step, the ledger's conventions (plan/traffic.py)
Traffic = dict[tuple[str, str], tuple[int | None, int]]
F32, F64 = 4, 8


def _no_tables(fields: Mapping[str, Any]) -> int:
    return 0


@dataclass(frozen=True)
class ObjectiveSpec:
    """One objective's facts. ``fields``: the ``LossConfig`` keys a ``--loss`` name sets, sectioned as the
    config reads them (``{"kind": "fastclip", "fastclip": {"version": "v2"}}``: what ``toolkit plan`` knows);
    ``cfg``: the trainer's ``LossConfig``. Its own settings live in its section of
    ``LossConfig`` (``cfg.fastclip``), declared in its folder's ``config.py``."""

    kind: str
    target: str  # "module:Class" of its TrainingLoss, imported only when built
    title: str = ""  # its name in `toolkit train --help`'s list of objectives (the paper's); "": the kind
    # --loss NAME -> the LossConfig fields it sets besides kind; empty: the one name ``kind``
    names: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    modes: tuple[str, ...] = CLIP_MODES  # distributed modes it runs in
    modes_note: str = ""  # why it refuses the other modes (part of the refusal's message)
    # the mode a config that names none gets; "": LossConfig's own default (fastclip) where it runs in it,
    # else the first of ``modes`` (so an objective of the gather mode only works without a mode flag)
    default_mode: str = ""
    # per-sample float32 columns it keeps in host tables (FastCLIP's u1, u2: 2); sizes toolkit plan's tables
    table_columns: Callable[[Mapping[str, Any]], int] = _no_tables
    # its feature and scalar traffic per rank per step: (mode, world, b, d, feature_bytes, fields) -> Traffic;
    # None: the CLIP loss's modes (plan/traffic.py's table, docs/distributed.md)
    traffic: Callable[..., Traffic] | None = None
    # the model's learnable logit bias it needs (open_clip's init_logit_bias), from its LossConfig; None: none
    init_logit_bias: Callable[[Any], float | None] = lambda cfg: None
    # τ = 1/a the model's logit scale starts from when trained from scratch
    initial_tau: Callable[[Any], float] = lambda cfg: cfg.tau_init
    # whether the model's global logit scale p is trained
    learns_logit_scale: Callable[[Any], bool] = lambda cfg: cfg.learn_tau
    # its published training settings: preset name -> a Preset's fields as plain data (train/presets.py)
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    def loss_names(self) -> dict[str, dict[str, Any]]:
        """--loss NAME -> every LossConfig field it sets, kind included."""
        return {
            name: {"kind": self.kind, **fields} for name, fields in (self.names or {self.kind: {}}).items()
        }

    def mode_when_unset(self, fallback: str) -> str:
        """The mode of a config that names none: ``default_mode``, else ``fallback`` (LossConfig's default)
        where this objective runs in it, else its first mode."""
        return self.default_mode or (fallback if fallback in self.modes else self.modes[0])

    def check_mode(self, mode: str) -> None:
        """Refuse a distributed mode this objective does not run in, naming the ones it does."""
        if mode in self.modes:
            return
        if len(self.modes) == 1:
            raise ValueError(
                f"{self.kind} runs in the {self.modes[0]} mode only (got mode {mode!r}); "
                + (self.modes_note or f"set loss.mode to {self.modes[0]}")
            )
        raise ValueError(
            f"the {self.kind} loss has no {mode} mode: "
            + (self.modes_note or f"use mode {', '.join(self.modes)}")
        )
