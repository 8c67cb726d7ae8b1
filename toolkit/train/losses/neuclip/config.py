"""NeuCLIP's own settings: ``NeuCLIPConfig``, the ``loss.neuclip`` section of ``LossConfig`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from toolkit.core.config import option


@dataclass(frozen=True)
class NeuCLIPConfig:
    """NeuCLIP's normaliser network (arXiv 2511.08417; defaults: the paper's, docs/neuclip.md)."""

    num_prototypes: int = option(
        4096,
        ge=1,
        doc="Prototypes m per side: the network predicts a sample's "
        "log-normaliser as an LSE over them (the paper's hidden width).",
    )
    lr: float = option(
        0.01, gt=0, doc="AdaGrad learning rate of the prototypes (the paper trains the network with AdaGrad)."
    )
    inner_steps: int = option(
        10, ge=1, doc="Network updates per optimiser step, all on that step's global batch (the paper's T_u)."
    )
    restart_every_steps: int = option(
        500,
        ge=0,
        doc="Re-initialise the prototypes from the current batch's "
        "embeddings every this many steps (the paper's T_r); 0: never.",
    )
    adagrad_eps: float = option(1e-10, gt=0, doc="Denominator ε of the AdaGrad update.")
    fit_order: Literal["before", "after"] = option(
        "before",
        doc="When the network is fitted on a step's batch: before the model step uses its predictions "
        "(the paper's order) or after it (predictions out of sample; docs/neuclip.md).",
    )
