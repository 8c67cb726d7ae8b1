"""FastCLIP's own settings: ``FastCLIPConfig``, the ``loss.fastclip`` section of ``LossConfig``
(torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from toolkit.core.config import option

Version = Literal["v0", "v1", "v2", "v3"]
GammaScheduleName = Literal["constant", "cosine", "cosine_step"]
GammaRule = Literal["fixed", "drrho"]
UUpdate = Literal["moving_average", "scent"]


@dataclass(frozen=True)
class FastCLIPConfig:
    """FastCLIP's version, its estimators' inner learning rate γ and update rule, and v2's per-sample τ rule
    (docs/fastclip.md). ρ, ε and the shared τ settings are ``LossConfig``'s."""

    version: Version = option(
        "v3",
        doc="FastCLIP version: v0 learnable τ, v1 constant τ, v2 individual τ per "
        "sample, v3 (RGCL-g) learnable τ with the robust term ρ.",
    )
    gamma_min: float = option(0.2, gt=0, le=1, doc="FastCLIP's final inner learning rate γ (1 in epoch 0).")
    gamma_decay_epochs: int = option(18, ge=1, doc="Epochs over which γ decays from 1 to gamma_min.")
    gamma_schedule: GammaScheduleName = option(
        "cosine",
        doc="γ schedule: cosine (per epoch), cosine_step (per step) or constant (gamma_min after epoch 0).",
    )
    # added after checkpoints recorded this section: omit_at_default keeps their records and hashes valid
    gamma_rule: GammaRule = option(
        "fixed",
        doc="FastCLIP's final γ: fixed (gamma_min) or drrho (DRRho-CLIP's README: min(1, 4.177·E^-0.7265) "
        "with E = gamma_decay_epochs, which the trainer sets to the run's epochs unless given; "
        "gamma_min is then unused).",
        omit_at_default=True,
    )
    u_update: UUpdate = option(
        "moving_average",
        doc="FastCLIP v0/v1/v3 estimator update: moving_average (u ← (1−γ)u + γg) or scent (SCENT's "
        "proximal mirror-descent step, per sample γ_i = σ(log(u_i+ε) + γ_s), with γ_s following "
        "the γ schedule towards scent_gamma; docs/fastclip.md).",
        omit_at_default=True,
    )
    scent_gamma: float = option(
        10.0,
        doc="u_update scent: the final offset γ_s of the per-sample step σ(log(u_i+ε) "
        "+ γ_s) (SCENT's published runs: 10 with gamma_schedule constant).",
        omit_at_default=True,
    )
    u_drift: Literal["none", "batch"] = option(
        "none",
        doc="FastCLIP v0/v1/v3: none (the reference's moving average) or batch: shift the batch's old "
        "estimators by their mean log(g/u_old) before averaging, removing the drift they share since "
        "their last visit (docs/fastclip.md).",
    )
    tau_min: float = option(0.01, gt=0, doc="v2: lower clamp of the per-sample τ.")
    tau_max: float = option(1.0, gt=0, doc="v2: upper clamp of the per-sample τ.")
    tau_grad_clamp: float = option(5.0, gt=0, doc="v2: the per-sample τ gradient is clipped to ±this.")
    tau_beta1: float = option(
        0.9, ge=0, doc="v2: first-moment decay of the per-sample τ rule (0 in epoch 0)."
    )
    tau_beta2: float = option(0.999, ge=0, doc="v2: second-moment decay of the per-sample τ rule.")
    tau_eps: float = option(
        1e-8, gt=0, doc="v2: denominator ε of the per-sample τ rule (added to v̂, not √v̂, as the reference)."
    )

    def __post_init__(self) -> None:
        for name in ("tau_beta1", "tau_beta2"):  # bias correction divides by 1 − β^(epoch+1)
            if not getattr(self, name) < 1:
                raise ValueError(f"{name} must be < 1, got {getattr(self, name)}")
        if self.tau_min > self.tau_max:
            raise ValueError(f"tau_min ({self.tau_min}) must not exceed tau_max ({self.tau_max})")
        if self.u_update == "scent" and self.gamma_rule != "fixed":
            raise ValueError(
                f"gamma_rule: {self.gamma_rule} sets the moving average's γ, which u_update: scent "
                "replaces by its per-sample step (set scent_gamma instead)"
            )

    def check_objective(self, loss: Any) -> None:
        """Refuse the estimator rules (u_drift, u_update, gamma_rule) where ``loss`` (the ``LossConfig``
        holding this section, which calls it) has no FastCLIP estimators u: another kind, or v2 for
        u_drift/u_update."""
        own = loss.kind == "fastclip"
        if self.gamma_rule != "fixed" and not own and loss.kind != "drrho":  # drrho: FastCLIP's γ, its rule
            raise ValueError(
                f"fastclip.gamma_rule: {self.gamma_rule} applies to FastCLIP's γ; this objective is "
                f"{loss.name}"
            )
        for name, plain in (("u_drift", "none"), ("u_update", "moving_average")):
            value = getattr(self, name)
            if value != plain and (not own or self.version == "v2"):
                raise ValueError(
                    f"fastclip.{name}: {value} applies to FastCLIP v0, v1 and v3 (their estimators "
                    f"u); this objective is {loss.name}"
                )
