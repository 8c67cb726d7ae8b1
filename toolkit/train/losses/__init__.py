"""Every training objective behind one interface: ``build_loss(cfg, data_size=, group=)``.

- ``config``: ``LossConfig`` (kind, version, mode, backend, γ schedule, τ rule, ρ, ε, v2 settings).
- ``base``: ``TrainingLoss``, the interface and its gradient convention (docs/architecture.md).
- ``openclip``: the CLIP loss over the global batch in any distributed mode; ``fastclip/``: FastCLIP v0–v3.
- ``modes`` (gather, disco; ``contrastive_loss``), ``ring`` (Inf-CL), ``anchors`` (the fastclip mode),
  ``common`` (what they share), ``temperature`` (the learnable τ's lr rule and clamp).

Importing the package loads only the torch-free config (so the CLI can validate without torch); the
objectives come from their modules, or from ``build_loss``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from toolkit.train.losses.config import LOSS_NAMES, LossConfig, loss_fields

if TYPE_CHECKING:
    from toolkit.train.losses.base import TrainingLoss

__all__ = ["LOSS_NAMES", "LossConfig", "build_loss", "loss_fields"]


def build_loss(cfg: LossConfig, data_size: int | None = None, group=None, **fastclip_options) -> TrainingLoss:
    """The objective ``cfg`` describes, for a dataset of ``data_size`` dense sample ids (FastCLIP's tables
    need it; openclip ignores it). Called by every rank of ``group`` (FastCLIP's shared tables are created
    collectively). ``fastclip_options``: ``table_dtype``, ``share_tables`` (see ``FastCLIPLoss``)."""
    from toolkit.train.losses.fastclip.loss import FastCLIPLoss
    from toolkit.train.losses.openclip import OpenCLIPLoss

    if cfg.kind == "openclip":
        return OpenCLIPLoss(cfg, group)
    if data_size is None:
        raise ValueError(f"{cfg.name} keeps per-sample state: build_loss needs data_size (the number of "
                         "sample ids of the training set)")
    return FastCLIPLoss(cfg, data_size, group, **fastclip_options)
