"""The model's learning-rate schedule: linear warmup, then cosine down to ``lr_min`` or constant.

Every parameter group is scaled by the same factor of its own ``initial_lr`` (so the logit-scale group
with lr_tau follows the model's curve unless ``TemperatureControl`` sets it), evaluated from the step
number alone: a resumed run needs no scheduler state.
"""

from __future__ import annotations

import math

from toolkit.train.optim import OptimConfig


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """The model lr at optimiser step ``step`` (0-based) of ``total_steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    decay_steps = max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    return cfg.lr_min + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.lr_min)


def set_lr(optimizer, step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Scale every group's ``initial_lr`` by lr_at(step)/lr; returns the model lr. Called by every rank."""
    lr = lr_at(step, total_steps, cfg)
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * lr / cfg.lr
    return lr
