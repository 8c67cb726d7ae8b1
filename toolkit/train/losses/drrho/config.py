"""DRRho-CLIP's own settings: ``DRRhoConfig``, the ``loss.drrho`` section of ``LossConfig`` (torch-free).

The paper's other knobs are FastCLIP's and live in ``LossConfig`` (τ, ρ, ε, the γ schedule and ``gamma_rule:
drrho``); its published run (docs/objectives.md) fixes τ = 0.01 (``learn_tau: false``), ρ = 11, ε = 1e-4, γ
from ``gamma_rule: drrho``.
"""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.core.config import option


@dataclass(frozen=True)
class DRRhoConfig:
    """How the reference model enters DRRho-CLIP's excess loss (docs/objectives.md)."""

    ref_weight: float = option(
        1.0,
        ge=0,
        doc="β in the excess pairwise loss ℓ(θ) − β·ℓ(θ_ref): 1 is the paper's DRRho risk; 0 leaves "
        "the reference out (FastCLIP v3 with DRRho's gradient scale). The reference's pairwise loss "
        "r_ij − r_ii is divided by the student's τ, as in the paper: with a fixed τ, β = τ/τ_ref "
        "gives the reference a temperature τ_ref of its own.",
    )
