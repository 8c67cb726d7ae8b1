"""Every training objective behind one interface: ``build_loss(cfg, data_size=, group=)``.

- ``config``: ``LossConfig`` (kind, mode, backend, τ settings, ρ, ε; one section per objective, declared in
  its folder's ``config.py``: ``loss.fastclip``, ``loss.siglip``, ``loss.neuclip``).
- ``registry``: the objectives' folders (``openclip/``, ``fastclip/``, ``siglip/``, ``neuclip/``, each with
  its ``spec.py``) and the ``--loss`` names; ``register`` plugs a new one in.
- ``base``: ``TrainingLoss``, the interface and its gradient convention (docs/architecture.md).
- ``openclip/``: the CLIP loss over the global batch in any distributed mode; ``fastclip/``: FastCLIP v0–v3.
- ``modes/``: the CLIP loss's distributed modes (``contrastive_loss``: gather, disco, ring, fastclip);
  ``temperature`` (the learnable τ's lr rule and clamp).

Importing the package loads only the torch-free config (so the CLI can validate without torch); the
objectives come from their modules, or from ``build_loss``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from toolkit.train.losses import registry
from toolkit.train.losses.config import LossConfig, loss_fields
from toolkit.train.losses.registry import register

if TYPE_CHECKING:
    from toolkit.train.losses.base import TrainingLoss

__all__ = ["LossConfig", "build_loss", "loss_fields", "objective_class", "register"]


def build_loss(cfg: LossConfig, data_size: int | None = None, group=None, **options) -> TrainingLoss:
    """The objective ``cfg`` describes (``cfg.kind`` looked up in the registry when called), for a dataset of
    ``data_size`` dense sample ids (objectives with per-sample state need it; the others ignore it).
    Called by every rank of ``group`` (FastCLIP's shared tables are created collectively). ``options``
    go to the objective's constructor (FastCLIP: ``table_dtype``, ``share_tables``; every objective:
    ``check_sizes``); those its constructor does not take are left out, so one call builds any objective."""
    import inspect

    cls = objective_class(cfg.kind)
    accepted = inspect.signature(cls.__init__).parameters
    options = {k: v for k, v in options.items() if k in accepted}
    if not cls.needs_data_size:
        return cls(cfg, group, **options)
    if data_size is None:
        raise ValueError(
            f"{cfg.name} keeps per-sample state: build_loss needs data_size (the number of "
            "sample ids of the training set)"
        )
    return cls(cfg, data_size, group, **options)


def objective_class(kind: str) -> type[TrainingLoss]:
    """The ``TrainingLoss`` subclass of objective ``kind`` (the registry's target), imported but not built:
    its class attributes (``reads_reference``, ``needs_data_size``) without allocating the objective's
    state."""
    import importlib

    module, _, name = registry.spec(kind).target.partition(":")
    return getattr(importlib.import_module(module), name)
