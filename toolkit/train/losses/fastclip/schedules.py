"""FastCLIP's inner learning rate γ (the global temperature's rules are in
``toolkit.train.losses.temperature``).

γ (``gamma_at_epoch``), as in the reference's ``adjust_gamma``: 1 in epoch 0 (the u tables are filled
with fresh estimates), then ``cosine`` from 1 down to γ_min over ``decay_epochs`` epochs and γ_min after,
or ``constant`` (γ_min from epoch 1). ``cosine_step`` is our per-step variant: the same curve evaluated
at fractional epochs step/steps_per_epoch (equal to ``cosine`` at epoch boundaries, smooth in between).

``drrho_gamma``: the final γ the DRRho-CLIP README recommends for a run of E epochs (``gamma_rule: drrho``).
``final_gamma``: the value a config's schedule decays to (γ_min, the DRRho rule's, or SCENT's offset γ_s).
"""

from __future__ import annotations

import math

from toolkit.train.losses.fastclip.config import FastCLIPConfig, GammaScheduleName

# Optimization-AI/DRRho-CLIP, README.md ("--gamma ... We recommend to set it following
# γ = min(1.0, 4.177·E^(−0.7265)), where E is the number of epochs"; "--gamma_decay_epochs ... We recommend
# to set it to --epochs"), with --gamma_schedule cosine in its sample scripts.
DRRHO_SCALE, DRRHO_POWER = 4.177, -0.7265


def drrho_gamma(epochs: int) -> float:
    """min(1, 4.177·E^−0.7265) for a run of E ≥ 1 planned epochs: 1 (no moving average) up to E = 7."""
    if epochs < 1:
        raise ValueError(f"the DRRho γ rule needs the planned epochs E >= 1, got {epochs}")
    return min(1.0, DRRHO_SCALE * float(epochs) ** DRRHO_POWER)


def final_gamma(cfg: FastCLIPConfig) -> float:
    """What a ``loss.fastclip`` section's γ schedule ends at: SCENT's offset γ_s (u_update scent), the DRRho
    rule at E = gamma_decay_epochs (gamma_rule drrho) or gamma_min."""
    if cfg.u_update == "scent":
        return cfg.scent_gamma
    if cfg.gamma_rule == "drrho":
        return drrho_gamma(cfg.gamma_decay_epochs)
    return cfg.gamma_min


def _cosine(progress: float, gamma_min: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - gamma_min) + gamma_min


def gamma_at_epoch(epoch: int, gamma_min: float, decay_epochs: int, schedule: GammaScheduleName) -> float:
    """γ for a whole epoch (``cosine_step`` gives its value at the epoch's first step)."""
    if epoch <= 0:
        return 1.0
    if epoch >= decay_epochs or schedule == "constant":
        return gamma_min
    return _cosine(epoch / decay_epochs, gamma_min)


def gamma_at_step(
    step: int, steps_per_epoch: int, gamma_min: float, decay_epochs: int, schedule: GammaScheduleName
) -> float:
    """γ at global optimiser step ``step``; epoch schedules are constant within an epoch."""
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
    epoch = step // steps_per_epoch
    if schedule != "cosine_step" or epoch <= 0:
        return gamma_at_epoch(epoch, gamma_min, decay_epochs, schedule)
    progress = step / (steps_per_epoch * decay_epochs)
    return gamma_min if progress >= 1.0 else _cosine(progress, gamma_min)
