"""The reference's published training settings (Optimization-AI/fast_clip README), as ready-made configs.

A preset is a whole training setting, not just a loss: model, global batch, epochs, optimiser with its
schedule, and the objective. Its ``model``, ``batch_size``, ``epochs``, ``train_num_samples``, ``loss``
(a ``LossConfig``) and ``optim`` (an ``OptimConfig``) carry the same names and types as the trainer's
config, so ``train_overrides()`` applies them without renaming anything; the other fields say where
the setting comes from. Batch sizes are global (GPUs × per-GPU batch of the reference scripts). Fields
the reference does not publish for a setting are None (set them for your run).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from toolkit.core.config import option, to_dict
from toolkit.train.losses.config import LossConfig
from toolkit.train.optim import OptimConfig


@dataclass(frozen=True)
class Preset:
    """One published training setting."""

    description: str = option(doc="What the setting is and where it comes from.")
    dataset: str = option(doc="Training set of the reference run.")
    reference_layout: str = option("", doc="GPUs x per-GPU batch in the reference script.")
    data_size: int | None = option(None, doc="Samples (ids) of the reference's training set (None: not published).")
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


def _v3(lr_tau: float, rho: float, gamma_min: float, gamma_decay_epochs: int, **extra: Any) -> LossConfig:
    return LossConfig(kind="fastclip", version="v3", lr_tau=lr_tau, lr_tau_schedule="step_thresh", rho=rho,
                      gamma_min=gamma_min, gamma_decay_epochs=gamma_decay_epochs, **extra)


_CC3M = Preset(
    description="CC3M, ResNet-50, FastCLIP-v3 (reference README, medium scale)", dataset="cc3m",
    reference_layout="8 GPUs x 128", data_size=3318333, model="RN50", batch_size=1024, epochs=37,
    train_num_samples=2723840, loss=_v3(2e-4, 6.5, 0.2, 18),
    optim=OptimConfig(lr=1e-3, weight_decay=0.1, warmup_steps=10000))
_CC3M_LOSS = dict(gamma_min=0.2, gamma_decay_epochs=18)

PRESETS: dict[str, Preset] = {
    "cc3m": _CC3M,
    "cc3m-v0": dataclasses.replace(
        _CC3M, description="CC3M, ResNet-50, FastCLIP-v0 (reference README)",
        loss=LossConfig(kind="fastclip", version="v0", **_CC3M_LOSS)),
    "cc3m-v1": dataclasses.replace(
        _CC3M, description="CC3M, ResNet-50, FastCLIP-v1: constant τ (reference README)",
        loss=LossConfig(kind="fastclip", version="v1", **_CC3M_LOSS)),
    # the reference passes the model optimiser's betas and eps to v2's per-sample τ rule
    "cc3m-v2": dataclasses.replace(
        _CC3M, description="CC3M, ResNet-50, FastCLIP-v2: individual τ (reference README)",
        loss=LossConfig(kind="fastclip", version="v2", lr_tau=0.0133, lr_tau_schedule="const", tau_init=0.03,
                        rho=7.0, tau_beta1=0.9, tau_beta2=0.999, tau_eps=1e-8, **_CC3M_LOSS)),
    "cc3m-openclip": dataclasses.replace(
        _CC3M, description="CC3M, ResNet-50, OpenCLIP baseline (reference README)",
        loss=LossConfig(kind="openclip", mode="gather")),
    "cc12m": Preset(
        description="CC12M, ViT-B/32, FastCLIP-v3 (reference README, large scale)", dataset="cc12m",
        reference_layout="8 GPUs x 256", data_size=12423374, model="ViT-B-32", batch_size=2048, epochs=33,
        train_num_samples=9187328, loss=_v3(1e-4, 8.5, 0.2, 16),
        optim=OptimConfig(lr=4e-4, weight_decay=0.1, beta2=0.98, eps=1e-6, warmup_steps=10000)),
    "laion": Preset(
        description="LAION-400M, ViT-B/16, FastCLIP-v3 (FastCLIP paper, xlarge scale; epochs and sizes not "
                    "published in the README, warmup assumed as for CC3M/CC12M)", dataset="laion400m",
        model="ViT-B-16", batch_size=5120, loss=_v3(5e-5, 16.0, 0.8, 10, eps=1e-6),
        optim=OptimConfig(lr=2e-4, lr_min=4e-5, weight_decay=0.2, beta2=0.98, eps=1e-6, warmup_steps=10000)),
}


def get_preset(name: str) -> Preset:
    """The preset called ``name``; a clear error listing the known ones otherwise."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name]
