"""SigLIP's own settings: ``SigLIPConfig``, the ``loss.siglip`` section of ``LossConfig`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass

from toolkit.core.config import option


@dataclass(frozen=True)
class SigLIPConfig:
    """The sigmoid loss's learnable scale and bias at initialisation (SigLIP's paper: t = 10, b = −10)."""

    scale_init: float = option(
        10.0,
        gt=0,
        doc="Initial scale t = exp(logit_scale) of a model trained from "
        "scratch (SigLIP: 10; replaces loss.tau_init).",
    )
    bias_init: float = option(
        -10.0,
        doc="Initial learnable logit bias b (SigLIP: -10), saved in the model's "
        "open_clip config as init_logit_bias.",
    )
