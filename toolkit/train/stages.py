"""Resolution and text-length stages (CLIPA, arXiv 2305.07017): most steps at low resolution and short text,
the rest at full.

The plan (``stages``): stages separated by ``;``, each ``SETTINGS:FRACTION``, SETTINGS a comma list of
``<N>px`` (image side) and ``<K>tok`` (text positions), either left out for the model's own; FRACTION the
share of the run's steps. ``"112px,16tok:0.9;224px:0.1"``: 90 % of the steps at 112 px with 16 text positions,
then 10 % at 224 px with the full context. Fractions must sum to 1; stage i covers steps
[round(T·F_i-1), round(T·F_i)) of T, F the running sums (so every step has exactly one stage).

Every rank, every step: ``StagePlan.begin(step, model, update)`` sets the step's image side on the
``TrainModel`` (pixels resized on the device after the crop: pixel, JPEG and index sets alike, the crop
margin logic unchanged; the ViT's positional table resized bicubically, ``models/resolution.py``) and, with
``stage_lr: stage``, restarts the lr schedule (warmup and cosine) over the stage's steps; ``tokens_fn``
shortens the host token batch (first k-1 tokens + end-of-text, or a random subset: ``stage_text``). Everything
follows from the step number: a resume mid-stage or across a switch continues exactly, with no state saved.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_PART = re.compile(r"^(\d+)(px|tok)$")


@dataclass(frozen=True)
class Stage:
    image_px: int  # 0: the model's own resolution
    text_tokens: int  # 0: the model's context
    fraction: float
    start: int = 0  # first step (0-based) of the stage
    stop: int = 0  # one past its last step


def parse(plan: str) -> list[Stage]:
    """The stages of a plan string (module docstring); ValueError naming the bad part."""
    stages = []
    for item in (s.strip() for s in plan.split(";")):
        settings, sep, fraction = item.rpartition(":")
        if not sep:
            raise ValueError(f"stages: {item!r} has no ':FRACTION' (e.g. '112px,16tok:0.9;224px:0.1')")
        values = {"px": 0, "tok": 0}
        for part in filter(None, (p.strip() for p in settings.split(","))):
            match = _PART.match(part)
            if not match:
                raise ValueError(f"stages: {part!r} in {item!r} is neither <N>px nor <K>tok")
            values[match.group(2)] = int(match.group(1))
        try:
            share = float(fraction)
        except ValueError:
            raise ValueError(f"stages: fraction {fraction!r} of {item!r} is not a number") from None
        if not 0 < share <= 1:
            raise ValueError(f"stages: fraction {share} of {item!r} must be in (0, 1]")
        stages.append(Stage(values["px"], values["tok"], share))
    if abs(sum(s.fraction for s in stages) - 1.0) > 1e-6:
        raise ValueError(
            f"stages: the fractions of {plan!r} sum to {sum(s.fraction for s in stages):g}, not 1"
        )
    return stages


def schedule(stages: list[Stage], total_steps: int) -> list[Stage]:
    """``stages`` with their step ranges over a run of ``total_steps`` (module docstring)."""
    out, done, start = [], 0.0, 0
    for s in stages:
        done += s.fraction
        stop = total_steps if s is stages[-1] else round(total_steps * done)
        out.append(Stage(s.image_px, s.text_tokens, s.fraction, start, stop))
        start = stop
    return out


def check(stages: list[Stage], image_size: int, patch_size: int, context: int) -> None:
    """Refuse a stage the model cannot run: a side that is not a multiple of the patch or above the model's,
    a text length outside [2, context]."""
    for s in stages:
        if s.image_px and (s.image_px % patch_size or s.image_px > image_size):
            raise ValueError(
                f"stages: {s.image_px} px must be a multiple of the patch size {patch_size} and at "
                f"most the model's {image_size} px"
            )
        if s.text_tokens and not 2 <= s.text_tokens <= context:
            raise ValueError(f"stages: {s.text_tokens} text tokens must be in [2, the context {context}]")


@dataclass
class StagePlan:
    """The run's stages (``schedule``d) and how they apply (module docstring)."""

    stages: list[Stage]
    restart_lr: bool
    text_mode: str
    seed: int

    def at(self, step: int) -> Stage:
        """The stage of 0-based ``step`` (the last one for a step past the plan)."""
        return next((s for s in self.stages if s.start <= step < s.stop), self.stages[-1])

    def begin(self, step: int, model: Any, update: Any, lr: float) -> float:
        """Set the step's image side on ``model`` (a ``TrainModel``) and, with ``restart_lr``, the lr of the
        stage's own schedule (every rank). Returns the model lr."""
        stage = self.at(step)
        model.image_px = stage.image_px
        if not self.restart_lr:
            return lr
        from toolkit.train.schedule import set_lr

        lr = set_lr(update.optimizer, step - stage.start, stage.stop - stage.start, update.optim_cfg)
        if update.tau_sets_lr:  # the temperature's own lr rule wins over the schedule for its group
            update.tau_ctl.before_step(step)
        return lr

    def tokens_fn(self, step: int, model: Any, index: Any) -> Callable[[Any], Any]:
        """The host token batch's cut for ``step``: the stage's shortening, then ``model.trim_tokens``."""
        k = self.at(step).text_tokens
        if not k:
            return model.trim_tokens
        from toolkit.core.seeds import stream_seed
        from toolkit.models.resolution import shorten_tokens

        clip = model.clip
        seed = stream_seed(self.seed, step, 0, 1)
        return lambda tokens: model.trim_tokens(
            shorten_tokens(tokens, k, clip.text_pool_type, clip.text_eos_id, self.text_mode, seed, index)
        )


def build(cfg: Any, model: Any, model_cfg: dict, total_steps: int) -> StagePlan | None:
    """The run's ``StagePlan`` for ``cfg.stages`` (None without stages); prepares ``model`` (a ``TrainModel``)
    for other resolutions; ``model_cfg``: its open_clip config. Every rank, after the model is built, before
    compile and DDP."""
    if not cfg.stages:
        return None
    from toolkit.models import resolution
    from toolkit.models.registry import config_context_length, config_image_size

    stages = schedule(parse(cfg.stages), total_steps)
    patch = int(model_cfg.get("vision_cfg", {}).get("patch_size", 1))
    check(stages, config_image_size(model_cfg), patch, config_context_length(model_cfg))
    if any(s.image_px for s in stages):
        if model.image_role != "image":
            raise ValueError("stages: an image side needs pixel data (this run trains on image features)")
        resolution.allow_any_resolution(model.clip)
    if any(s.text_tokens for s in stages) and not model.trims_text:
        raise ValueError("stages: text lengths need open_clip's causal text tower on token data")
    return StagePlan(stages, cfg.stage_lr == "stage", cfg.stage_text, cfg.seed)
