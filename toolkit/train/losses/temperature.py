"""The learnable global temperature τ = 1/exp(p) of openclip, FastCLIP-v0 and v3: its lr rule and clamp.

``TemperatureControl`` is what the trainer calls: it sets the learning rate of the logit-scale parameter
group (``step_thresh`` as in the FastCLIP reference: lr_tau, times 1/3 while τ = exp(−p) ≤ 0.03; or
``const`` / ``cosine``) and clamps p to [0, ln 100] after each optimiser step, exactly where the
reference (and open_clip) does.
"""

from __future__ import annotations

import math

import torch

from toolkit.train.losses.config import TauLrSchedule

MAX_LOGIT_SCALE = math.log(100.0)


class TemperatureControl:
    """Learning rate of the τ (logit-scale) parameter group and the clamp of p = logit_scale.

    Call ``before_step(step)`` before each ``optimizer.step()`` (the reference sets every learning rate
    at the start of the step, from the current p) and ``after_step()`` right after it (clamp).
    ``step_thresh``: lr = lr_tau · ratio for the last threshold τ has reached (τ ≤ 0.03 → lr_tau/3),
    re-evaluated every step (τ rising above 0.03 again restores lr_tau, as in the reference).
    ``cosine``: linear warmup over ``warmup_steps`` then cosine to 0 at ``total_steps``; ``const``: lr_tau.
    """

    def __init__(
        self,
        logit_scale: torch.nn.Parameter,
        param_group: dict,
        lr_tau: float,
        schedule: TauLrSchedule = "step_thresh",
        warmup_steps: int = 0,
        total_steps: int = 1,
        thresholds: tuple[float, ...] = (0.03,),
        ratios: tuple[float, ...] = (1.0 / 3.0,),
        max_logit_scale: float = MAX_LOGIT_SCALE,
    ):
        if schedule not in ("step_thresh", "const", "cosine"):
            raise ValueError(f"unknown tau lr schedule {schedule!r}; choose step_thresh, const or cosine")
        if len(thresholds) != len(ratios):
            raise ValueError("thresholds and ratios must have the same length")
        self.p, self.group, self.lr_tau = logit_scale, param_group, lr_tau
        self.schedule, self.warmup_steps, self.total_steps = schedule, warmup_steps, max(total_steps, 1)
        self.thresholds, self.ratios, self.max_logit_scale = thresholds, ratios, max_logit_scale

    def lr_at(self, step: int) -> float:
        if self.schedule == "cosine":
            if step < self.warmup_steps:
                return self.lr_tau * (step + 1) / self.warmup_steps
            e, es = step - self.warmup_steps, max(self.total_steps - self.warmup_steps, 1)
            return 0.5 * (1.0 + math.cos(math.pi * e / es)) * self.lr_tau
        lr = self.lr_tau
        if self.schedule == "step_thresh":
            tau = 1.0 / math.exp(float(self.p.detach()))
            for thresh, ratio in zip(self.thresholds, self.ratios, strict=True):
                if tau > thresh:
                    break
                lr = self.lr_tau * ratio
        return lr

    def before_step(self, step: int) -> float:
        """Set and return the τ group's learning rate for optimiser step ``step``."""
        self.group["lr"] = self.lr_at(step)
        return self.group["lr"]

    @torch.no_grad()
    def after_step(self) -> None:
        """Clamp p to [0, max_logit_scale] (ln 100 unless ``loss.tau_floor`` says otherwise; the reference
        clamps after every optimiser step)."""
        self.p.clamp_(0.0, self.max_logit_scale)
