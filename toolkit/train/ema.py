"""``--ema-decay``: an exponential moving average of the weights, e ← d·e + (1−d)·w after every applied step.

``EMA`` keeps a full copy of the open_clip model (eval mode, no gradients), so the average is itself an
open_clip model: the evaluation callback runs on it beside the raw weights (its metrics are logged as
``eval_ema/...`` next to ``eval/...``), and it is saved as its own model folder, OUT/model-ema, loadable
by open_clip like OUT/model. Floating-point buffers (BatchNorm statistics) are averaged like the weights;
integer buffers are copied. Every rank holds the same average (DDP keeps the weights equal, and a
skipped non-finite step updates nothing), so there is no communication. The average starts at the
weights the run starts from (``init`` or the random init) and is checkpointed as ``ema.safetensors``, so
a resume continues it exactly; a checkpoint written without EMA restarts it from the loaded weights.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

FILE = "ema.safetensors"
MODEL_DIR = "model-ema"


class EMA:
    """The moving average of ``clip``'s weights with ``decay`` (module docstring). ``model``: the averaged
    open_clip model (evaluate or save it like the trained one)."""

    def __init__(self, clip: nn.Module, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema_decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.model = copy.deepcopy(clip).eval().requires_grad_(False)

    def _pairs(self, clip: nn.Module) -> tuple[list[Tensor], list[Tensor], list[tuple[Tensor, Tensor]]]:
        """(averaged float tensors, their sources, integer (target, source) pairs) in state-dict order."""
        mine, theirs = self.model.state_dict(keep_vars=True), clip.state_dict(keep_vars=True)
        floats = [k for k, v in mine.items() if v.is_floating_point()]
        ints = [(mine[k], theirs[k]) for k, v in mine.items() if not v.is_floating_point()]
        return [mine[k].data for k in floats], [theirs[k].detach() for k in floats], ints

    @torch.no_grad()
    def update(self, clip: nn.Module) -> None:
        """One step of the average toward ``clip``'s current weights (every rank, after an applied step)."""
        targets, sources, ints = self._pairs(clip)
        torch._foreach_lerp_(
            targets, [s.to(t.dtype) for t, s in zip(targets, sources, strict=True)], 1.0 - self.decay
        )
        for target, source in ints:
            target.copy_(source)

    def state_dict(self) -> dict[str, Tensor]:
        return {k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.model.load_state_dict(state)

    @torch.no_grad()
    def restart_from(self, clip: nn.Module) -> None:
        """Set the average to ``clip``'s weights (a resume from a checkpoint without EMA)."""
        self.model.load_state_dict(clip.state_dict())

    def save_model(self, run_dir: str, model_cfg: dict[str, Any], preprocess_cfg: dict[str, Any]) -> str:
        """Rank 0: write RUN_DIR/model-ema as an open_clip model folder; returns its path."""
        from toolkit.models import weights

        out = str(Path(run_dir) / MODEL_DIR)
        weights.save_model(self.model, model_cfg, out, preprocess_cfg)
        return out


def build(clip: nn.Module, decay: float) -> EMA | None:
    """The EMA of ``clip`` for ``--ema-decay`` (None when 0: no average kept)."""
    return EMA(clip, decay) if decay > 0 else None


def prefixed(metrics: dict[str, float]) -> dict[str, float]:
    """The EMA model's evaluation metrics under ``eval_ema/`` (``eval/x/y`` -> ``eval_ema/x/y``)."""
    return {("eval_ema/" + k.removeprefix("eval/")): v for k, v in metrics.items()}
