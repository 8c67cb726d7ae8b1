"""The reference's published FastCLIP settings (Optimization-AI/fast_clip README, DESIGN.md).

Batch sizes are global (GPUs × per-GPU batch of the reference scripts). Fields the reference does not
publish for a setting are None (set them for your run). ``loss_kwargs()`` and ``optim_config()`` turn
a preset into ``FastCLIPLoss`` arguments and the model ``OptimConfig``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from toolkit.core.config import option
from toolkit.train.fastclip.schedules import GammaScheduleName, TauLrSchedule
from toolkit.train.optim import OptimConfig, OptimizerName

LossName = Literal["v0", "v1", "v2", "v3", "openclip"]


@dataclass(frozen=True)
class FastCLIPPreset:
    """One published training setting."""

    description: str = option(doc="What the setting is and where it comes from.")
    dataset: str = option(doc="Training set of the reference run.")
    model: str = option(doc="open_clip model name of the reference run.")
    loss: LossName = option("v3", doc="FastCLIP version (v0-v3) or the openclip baseline.")
    global_batch_size: int = option(1024, ge=1, doc="Pairs per step over all ranks.")
    reference_layout: str = option("", doc="GPUs x per-GPU batch in the reference script.")
    epochs: int | None = option(None, doc="Training epochs (None: not published).")
    data_size: int | None = option(None, doc="Size of the id space of the per-sample tables (None: not published).")
    train_num_samples: int | None = option(None, doc="Samples per epoch in the reference run.")
    warmup_steps: int = option(10000, ge=0, doc="Linear lr warmup steps.")
    lr: float = option(1e-3, gt=0, doc="Peak model learning rate (cosine schedule).")
    lr_min: float = option(0.0, ge=0, doc="Final learning rate of the cosine schedule.")
    weight_decay: float = option(0.1, ge=0, doc="Weight decay of the weights.")
    optimizer: OptimizerName = option("adamw", doc="Model optimiser.")
    beta1: float = option(0.9, doc="AdamW beta1.")
    beta2: float = option(0.999, doc="AdamW beta2 (0.98 for ViT in the reference).")
    eps: float = option(1e-8, doc="AdamW epsilon (1e-6 for ViT in the reference).")
    lr_tau: float | None = option(None, doc="Learning rate of τ (v3: its AdamW group; v2: per-sample rule).")
    lr_tau_schedule: TauLrSchedule = option("cosine", doc="Schedule of lr_tau: step_thresh, const or cosine.")
    tau_init: float = option(0.07, gt=0, doc="Initial temperature (v2: of every sample).")
    rho: float = option(8.0, ge=0, doc="ρ of the robust losses (v2, v3).")
    gamma_min: float = option(0.2, gt=0, le=1, doc="Final inner learning rate γ.")
    gamma_decay_epochs: int = option(18, ge=1, doc="Epochs of the γ decay.")
    gamma_schedule: GammaScheduleName = option("cosine", doc="γ schedule.")
    fastclip_eps: float = option(1e-14, gt=0, doc="ε added to u in the surrogate's denominators.")

    def loss_kwargs(self, data_size: int | None = None) -> dict:
        """Keyword arguments of ``FastCLIPLoss`` (version first); ``data_size`` overrides the preset's."""
        size = data_size if data_size is not None else self.data_size
        if self.loss == "openclip":
            raise ValueError("the openclip preset uses OpenCLIPLoss, which takes no FastCLIP arguments")
        if size is None:
            raise ValueError("data_size is not published for this preset: pass the size of your id space")
        kw = {"version": self.loss, "data_size": size, "gamma_min": self.gamma_min,
              "gamma_decay_epochs": self.gamma_decay_epochs, "gamma_schedule": self.gamma_schedule,
              "rho": self.rho, "eps": self.fastclip_eps}
        if self.loss == "v2":  # the reference passes the model optimiser's betas and eps to v2's τ rule
            kw.update(tau_init=self.tau_init, lr_tau=self.lr_tau, beta1_tau=self.beta1, beta2_tau=self.beta2,
                      eps_tau=self.eps)
        return kw

    def optim_config(self) -> OptimConfig:
        """The model optimiser; v3 (and v0) put τ in its own group with lr_tau (lr when unset)."""
        lr_tau = self.lr_tau if self.loss in ("v0", "v3", "openclip") else None
        return OptimConfig(name=self.optimizer, lr=self.lr, weight_decay=self.weight_decay, beta1=self.beta1,
                           beta2=self.beta2, eps=self.eps, lr_tau=lr_tau)


_CC3M = FastCLIPPreset(
    description="CC3M, ResNet-50, FastCLIP-v3 (reference README, medium scale)", dataset="cc3m", model="RN50",
    loss="v3", global_batch_size=1024, reference_layout="8 GPUs x 128", epochs=37, data_size=3318333,
    train_num_samples=2723840, warmup_steps=10000, lr=1e-3, weight_decay=0.1, lr_tau=2e-4,
    lr_tau_schedule="step_thresh", rho=6.5, gamma_min=0.2, gamma_decay_epochs=18)

PRESETS: dict[str, FastCLIPPreset] = {
    "cc3m": _CC3M,
    "cc3m-v0": dataclasses.replace(_CC3M, description="CC3M, ResNet-50, FastCLIP-v0 (reference README)",
                                   loss="v0", lr_tau=None, lr_tau_schedule="cosine"),
    "cc3m-v1": dataclasses.replace(_CC3M, description="CC3M, ResNet-50, FastCLIP-v1: constant τ (reference README)",
                                   loss="v1", lr_tau=None, lr_tau_schedule="cosine"),
    "cc3m-v2": dataclasses.replace(_CC3M, description="CC3M, ResNet-50, FastCLIP-v2: individual τ (reference README)",
                                   loss="v2", lr_tau=0.0133, lr_tau_schedule="const", tau_init=0.03, rho=7.0),
    "cc3m-openclip": dataclasses.replace(_CC3M, description="CC3M, ResNet-50, OpenCLIP baseline (reference README)",
                                         loss="openclip", lr_tau=None, lr_tau_schedule="cosine"),
    "cc12m": FastCLIPPreset(
        description="CC12M, ViT-B/32, FastCLIP-v3 (reference README, large scale)", dataset="cc12m",
        model="ViT-B-32", loss="v3", global_batch_size=2048, reference_layout="8 GPUs x 256", epochs=33,
        data_size=12423374, train_num_samples=9187328, warmup_steps=10000, lr=4e-4, weight_decay=0.1,
        beta2=0.98, eps=1e-6, lr_tau=1e-4, lr_tau_schedule="step_thresh", rho=8.5, gamma_min=0.2,
        gamma_decay_epochs=16),
    "laion": FastCLIPPreset(
        description="LAION-400M, ViT-B/16, FastCLIP-v3 (DESIGN.md / paper xlarge scale; epochs and sizes "
                    "not published in the README, warmup assumed as for CC3M/CC12M)", dataset="laion400m", model="ViT-B-16", loss="v3", global_batch_size=5120,
        warmup_steps=10000, lr=2e-4, lr_min=4e-5, weight_decay=0.2, beta2=0.98, eps=1e-6, lr_tau=5e-5,
        lr_tau_schedule="step_thresh", rho=16.0, gamma_min=0.8, gamma_decay_epochs=10, fastclip_eps=1e-6),
}


def get_preset(name: str) -> FastCLIPPreset:
    """The preset called ``name``; a clear error listing the known ones otherwise."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name]
