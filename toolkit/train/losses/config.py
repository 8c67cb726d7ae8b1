"""``LossConfig``: the settings every objective shares, and one section per objective for its own.

- Shared: ``kind`` (the objective, losses/registry.py), the distributed ``mode``, the kernels' ``backend``,
  the temperature (``tau_init``, ``learn_tau``, ``lr_tau``, ``lr_tau_schedule``) and the robust global
  contrastive loss's ``rho`` and ``eps``. ρ and ε stay here, not in a section: FastCLIP v2/v3 and NeuCLIP
  (and objectives built on them) use the same two terms of the same loss, so one key each keeps one meaning
  and one default, and ``loss.rho`` is read the same whatever the kind.
- Sections, each declared in its objective's folder: ``fastclip`` (``fastclip/config.py``: version, γ
  schedule and rules, estimator update, v2's per-sample τ rule), ``siglip`` (``siglip/config.py``: initial
  scale and bias), ``neuclip`` (``neuclip/config.py``: the normaliser network). A section checks itself
  and, with ``check_objective(loss)``, refuses its settings where the chosen ``kind`` does not use them.
- One layout: configs, records (the run's config.yaml, checkpoints' config and config hash), presets and
  the default objective all write the sections. ``fastclip``'s and ``siglip``'s fields were flat
  keys of ``loss`` in records written before 2026-11-26 (``version``, ``gamma_min``, ``siglip_scale_init``):
  such a key is refused, naming its new place (``MOVED_KEYS``), and a checkpoint recorded so is refused
  for resume (train/checkpoint/resume.py) with the same names.
The CLI's ``--loss fastclip-v3`` sets ``kind: fastclip, fastclip.version: v3``; ``--loss siglip`` sets
``kind: siglip``, ``--loss neuclip`` ``kind: neuclip``.
- ``kind: drrho``: DRRho-CLIP (docs/objectives.md): FastCLIP v3's estimators (the ``fastclip`` section's γ
  schedule and rule) on the excess pairwise loss over a reference model whose features the training set
  holds (``drrho`` section); τ learnt unless ``learn_tau: false``.
- ``kind: distill``: MobileCLIP's distillation (docs/objectives.md): (1 − λ)·CLIP loss + λ·KL from the
  reference model's similarity distribution (``distill`` section), on a training set precomputed with
  ``--reference-model``; gather or fastclip mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

from toolkit.core.config import option
from toolkit.train.losses import registry
from toolkit.train.losses.distill.config import DistillConfig
from toolkit.train.losses.drrho.config import DRRhoConfig
from toolkit.train.losses.fastclip.config import FastCLIPConfig
from toolkit.train.losses.neuclip.config import NeuCLIPConfig
from toolkit.train.losses.siglip.config import SigLIPConfig

Mode = Literal["gather", "disco", "ring", "fastclip"]  # the one list of distributed modes
MODES: tuple[str, ...] = get_args(Mode)
Backend = Literal["auto", "torch", "triton", "naive"]
TauLrSchedule = Literal["step_thresh", "const", "cosine"]
# The flat keys of ``loss`` in records written before 2026-11-26 -> where they live now: read nowhere, only
# named when refused (core.config's unknown-key error, the resume refusal of a checkpoint recorded so).
MOVED_KEYS: dict[str, str] = {
    **{f.name: f"fastclip.{f.name}" for f in dataclasses.fields(FastCLIPConfig)},
    **{f"siglip_{f.name}": f"siglip.{f.name}" for f in dataclasses.fields(SigLIPConfig)},
}


@dataclass(frozen=True)
class LossConfig:
    """The training objective (see module docstring)."""

    kind: str = option(
        "fastclip",
        doc="The objective (losses/registry.py): openclip (mini-batch CLIP loss), "
        "fastclip (global contrastive loss with per-sample estimators), siglip "
        "(sigmoid loss with a learnable bias), neuclip (FastCLIP's loss, "
        "log-normalisers predicted by a network), drrho (FastCLIP's loss on the "
        "excess over a reference model's, DRRho-CLIP), distill (CLIP loss + KL "
        "from a reference model's similarities).",
    )
    mode: Mode = option(
        "fastclip",
        doc="Distributed mode: gather (OpenCLIP), disco (DisCo-CLIP), ring (Inf-CL) "
        "or fastclip (no feature-gradient communication; FastCLIP's only mode). "
        "siglip: gather, ring or fastclip. Unset: the objective's default "
        "(its spec's default_mode: fastclip where it runs in it, else its "
        "first mode).",
    )
    backend: Backend = option(
        "auto",
        doc="Tiled-loss kernels: auto (triton on CUDA, else torch), torch, triton "
        "or naive (full matrix, for tests).",
    )
    tau_init: float = option(
        0.07,
        gt=0,
        doc="Initial temperature τ: the model's logit scale starts at "
        "log(1/τ); v2: every sample's initial τ. siglip: see "
        "siglip.scale_init.",
    )
    learn_tau: bool = option(
        True,
        doc="openclip, siglip, neuclip: learn τ (true) or keep it at tau_init (false). FastCLIP "
        "fixes this by version (v0, v3 learn it; v1 keeps it; v2 per sample).",
    )
    lr_tau: float | None = option(
        None,
        doc="Learning rate of τ: the logit-scale group's (openclip, v0, v3, neuclip; "
        "empty: the model lr) or v2's per-sample rule's (empty: 1e-2).",
    )
    lr_tau_schedule: TauLrSchedule = option(
        "cosine",
        doc="Schedule of the logit-scale group's lr: cosine (as the model's), const, or step_thresh "
        "(lr_tau, divided by 3 once τ <= 0.03: the reference's v3 rule).",
    )
    tau_floor: float = option(
        0.01,
        gt=0,
        le=1,
        omit_at_default=True,
        doc="Lowest value of a learned global τ (openclip, v0, v3, neuclip, drrho; v2's per-sample τ: "
        "fastclip.tau_min): the logit scale is clamped to log(1/tau_floor) after every step (0.01: "
        "open_clip's clamp of the scale at 100; with no loss named, the default objective sets 0.03, "
        "docs/objectives.md). A tau_init below it is raised to it at the first step.",
    )
    rho: float = option(8.0, ge=0, doc="ρ of the robust losses (v2, v3, neuclip).")
    eps: float = option(
        1e-14,
        gt=0,
        doc="ε added to the estimators u in the surrogate's denominators (neuclip: the ε of log(ε + g)).",
    )
    fastclip: FastCLIPConfig = option(
        factory=FastCLIPConfig, doc="FastCLIP's version, γ schedule and rules, v2's τ rule (kind fastclip)."
    )
    siglip: SigLIPConfig = option(factory=SigLIPConfig, doc="SigLIP's initial scale and bias (kind siglip).")
    neuclip: NeuCLIPConfig = option(factory=NeuCLIPConfig, doc="NeuCLIP's normaliser network (kind neuclip).")
    drrho: DRRhoConfig = option(
        factory=DRRhoConfig, doc="DRRho-CLIP's reference term (kind drrho).", omit_at_default=True
    )
    distill: DistillConfig = option(
        factory=DistillConfig,
        omit_at_default=True,
        doc="Distillation from the training set's reference model (kind distill): "
        "the KL's weight λ and the teacher's τ.",
    )
    moved_keys: ClassVar[dict[str, str]] = MOVED_KEYS  # named by core.config's unknown-key error

    @staticmethod
    def layered_defaults(data: Mapping[str, Any], source: str) -> dict[str, Any]:
        """Defaults beneath ``data`` (core.config.build): the mode of the objective's spec when ``data``
        names none (``ObjectiveSpec.mode_when_unset``), so ``--loss plain`` runs an objective of the gather
        mode only without ``--mode gather``."""
        if "mode" in data:
            return {}
        fallback = LossConfig.__dataclass_fields__["mode"].default
        try:
            return {"mode": registry.spec(data.get("kind", "fastclip")).mode_when_unset(fallback)}
        except (ValueError, TypeError):  # an unknown or malformed kind: __post_init__ names it
            return {}

    def __post_init__(self) -> None:
        registry.spec(self.kind).check_mode(self.mode)  # unknown kinds and modes it lacks, named
        for f in dataclasses.fields(self):  # each section refuses its settings where this kind ignores them
            check = getattr(getattr(self, f.name), "check_objective", None)
            if check is not None:
                check(self)

    @property
    def name(self) -> str:
        """The CLI's ``--loss`` name of the objective (openclip, fastclip-vN, ...)."""
        for name, fields in registry.loss_names().items():
            if fields["kind"] == self.kind and _matches(self, fields):
                return name
        return self.kind

    @property
    def initial_tau(self) -> float:
        """τ = 1/t the model's logit scale starts from when trained from scratch (siglip:
        1/siglip.scale_init)."""
        return registry.spec(self.kind).initial_tau(self)

    @property
    def init_logit_bias(self) -> float | None:
        """The learnable logit bias the model needs (open_clip's ``init_logit_bias``), None for none."""
        return registry.spec(self.kind).init_logit_bias(self)

    @property
    def learns_logit_scale(self) -> bool:
        """Whether the model's global logit scale p is trained (v2's per-sample τ lives in the loss)."""
        return registry.spec(self.kind).learns_logit_scale(self)


def _matches(cfg: Any, fields: Mapping[str, Any]) -> bool:
    """Whether config ``cfg`` has every value of ``fields`` (sections compared key by key)."""
    for key, want in fields.items():
        have = getattr(cfg, key)
        if not (
            _matches(have, want)
            if isinstance(want, Mapping) and dataclasses.is_dataclass(have)
            else have == want
        ):
            return False
    return True


def loss_fields(name: str) -> dict[str, Any]:
    """``--loss NAME`` (openclip, fastclip-v0 ... fastclip-v3, ...) -> the LossConfig keys it sets, sectioned
    as the config reads them ({kind[, fastclip: {version}]})."""
    return dict(registry.spec_of_name(name)[1])


def dotted(fields: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``fields`` as dotted keys, one per value (``{"fastclip": {"version": "v3"}}`` -> ``fastclip.version``):
    what the CLI's ``--loss`` sets, so a section's other keys from --config or --set stay."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        out.update(dotted(value, f"{prefix}{key}.") if isinstance(value, Mapping) else {prefix + key: value})
    return out
