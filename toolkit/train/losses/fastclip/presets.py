"""FastCLIP's published training settings (Optimization-AI/fast_clip README; the FastCLIP paper for LAION), as
plain ``Preset`` data (train/presets.py builds and lists them; ``toolkit train presets``).

A preset is a whole training setting: model, global batch (GPUs × per-GPU batch of the reference scripts),
epochs, optimiser and the objective (``loss`` with the new section keys; the flat ones load too). Fields the
reference does not publish for a setting are left out (None: set them for your run).
"""

from __future__ import annotations

from typing import Any

# The reference's CC3M run, everything but the objective (openclip/presets.py's baseline reuses it)
CC3M_RUN: dict[str, Any] = {
    "dataset": "cc3m",
    "reference_layout": "8 GPUs x 128",
    "data_size": 3318333,
    "model": "RN50",
    "batch_size": 1024,
    "epochs": 37,
    "train_num_samples": 2723840,
    "optim": {"lr": 1e-3, "weight_decay": 0.1, "warmup_steps": 10000},
}
_CC3M_GAMMA = {"gamma_min": 0.2, "gamma_decay_epochs": 18}


def _v3(
    lr_tau: float, rho: float, gamma_min: float, gamma_decay_epochs: int, **shared: Any
) -> dict[str, Any]:
    """The loss section of a published v3 run (the reference's step_thresh rule for τ's lr)."""
    return {
        "kind": "fastclip",
        "lr_tau": lr_tau,
        "lr_tau_schedule": "step_thresh",
        "rho": rho,
        **shared,
        "fastclip": {"version": "v3", "gamma_min": gamma_min, "gamma_decay_epochs": gamma_decay_epochs},
    }


PRESETS: dict[str, dict[str, Any]] = {
    "cc3m": {
        "description": "CC3M, ResNet-50, FastCLIP-v3 (reference README, medium scale)",
        **CC3M_RUN,
        "loss": _v3(2e-4, 6.5, 0.2, 18),
    },
    "cc3m-v0": {
        "description": "CC3M, ResNet-50, FastCLIP-v0 (reference README)",
        **CC3M_RUN,
        "loss": {"kind": "fastclip", "fastclip": {"version": "v0", **_CC3M_GAMMA}},
    },
    "cc3m-v1": {
        "description": "CC3M, ResNet-50, FastCLIP-v1: constant τ (reference README)",
        **CC3M_RUN,
        "loss": {"kind": "fastclip", "fastclip": {"version": "v1", **_CC3M_GAMMA}},
    },
    # the reference passes the model optimiser's betas and eps to v2's per-sample τ rule
    "cc3m-v2": {
        "description": "CC3M, ResNet-50, FastCLIP-v2: individual τ (reference README)",
        **CC3M_RUN,
        "loss": {
            "kind": "fastclip",
            "lr_tau": 0.0133,
            "lr_tau_schedule": "const",
            "tau_init": 0.03,
            "rho": 7.0,
            "fastclip": {
                "version": "v2",
                "tau_beta1": 0.9,
                "tau_beta2": 0.999,
                "tau_eps": 1e-8,
                **_CC3M_GAMMA,
            },
        },
    },
    "cc12m": {
        "description": "CC12M, ViT-B/32, FastCLIP-v3 (reference README, large scale)",
        "dataset": "cc12m",
        "reference_layout": "8 GPUs x 256",
        "data_size": 12423374,
        "model": "ViT-B-32",
        "batch_size": 2048,
        "epochs": 33,
        "train_num_samples": 9187328,
        "loss": _v3(1e-4, 8.5, 0.2, 16),
        "optim": {"lr": 4e-4, "weight_decay": 0.1, "beta2": 0.98, "eps": 1e-6, "warmup_steps": 10000},
    },
    "laion": {
        "description": "LAION-400M, ViT-B/16, FastCLIP-v3 (FastCLIP paper, xlarge scale; epochs and sizes "
        "not published in the README, warmup assumed as for CC3M/CC12M)",
        "dataset": "laion400m",
        "model": "ViT-B-16",
        "batch_size": 5120,
        "loss": _v3(5e-5, 16.0, 0.8, 10, eps=1e-6),
        "optim": {
            "lr": 2e-4,
            "lr_min": 4e-5,
            "weight_decay": 0.2,
            "beta2": 0.98,
            "eps": 1e-6,
            "warmup_steps": 10000,
        },
    },
}
