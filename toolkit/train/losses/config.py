"""``LossConfig``: every training objective's settings in one typed config (presets fill it as is).

- ``kind: openclip``: the standard CLIP loss over the global batch with a learnable (or fixed) τ, in any
  distributed ``mode``.
- ``kind: fastclip``: FastCLIP ``version`` v0–v3 (docs/fastclip.md) with per-sample estimators u, the
  inner learning-rate schedule γ, the temperature rule and the robust loss's ρ. Its distributed step is
  the ``fastclip`` mode (no feature-gradient communication); other modes are refused, not emulated.
- ``kind: siglip``: SigLIP's sigmoid loss over the global batch with the model's learnable scale t and bias
  b (initialised to ``siglip_scale_init`` and ``siglip_bias_init``), in the gather, ring or fastclip mode.
- ``kind: neuclip``: NeuCLIP (docs/neuclip.md): the robust global contrastive loss with each sample's
  log-normaliser predicted by a small prototype network (``neuclip`` section) instead of FastCLIP's
  per-sample estimators; learnable τ (``learn_tau``, ``lr_tau``), ρ and ε as v3. Also the fastclip mode only.
- ``kind: drrho``: DRRho-CLIP (docs/objectives.md): FastCLIP v3's estimators on the excess pairwise loss over a
  reference model whose features the training set holds (``drrho`` section); τ learnt unless ``learn_tau: false``.
- ``kind: distill``: MobileCLIP's distillation (docs/objectives.md): (1 − λ)·CLIP loss + λ·KL from the
  reference model's similarity distribution (``distill`` section), on a training set precomputed with
  ``--reference-model``; gather or fastclip mode.
The CLI's ``--loss fastclip-v3`` sets ``kind: fastclip, version: v3``; ``--loss siglip`` sets ``kind: siglip``, ``--loss neuclip`` ``kind: neuclip``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from toolkit.core.config import option
from toolkit.train.losses import registry
from toolkit.train.losses.distill.config import DistillConfig
from toolkit.train.losses.drrho.config import DRRhoConfig
from toolkit.train.losses.neuclip.config import NeuCLIPConfig

Version = Literal["v0", "v1", "v2", "v3"]
Mode = Literal["gather", "disco", "ring", "fastclip"]  # the one list of distributed modes
MODES: tuple[str, ...] = get_args(Mode)
Backend = Literal["auto", "torch", "triton", "naive"]
GammaScheduleName = Literal["constant", "cosine", "cosine_step"]
GammaRule = Literal["fixed", "drrho"]
UUpdate = Literal["moving_average", "scent"]
TauLrSchedule = Literal["step_thresh", "const", "cosine"]


@dataclass(frozen=True)
class LossConfig:
    """The training objective (see module docstring)."""

    kind: str = option("fastclip", doc="The objective (losses/registry.py): openclip (mini-batch CLIP loss), "
                                       "fastclip (global contrastive loss with per-sample estimators), siglip "
                                       "(sigmoid loss with a learnable bias), neuclip (FastCLIP's loss, "
                                       "log-normalisers predicted by a network), drrho (FastCLIP's loss on the "
                                       "excess over a reference model's, DRRho-CLIP), distill (CLIP loss + KL "
                                       "from a reference model's similarities).")
    version: Version = option("v3", doc="FastCLIP version: v0 learnable τ, v1 constant τ, v2 individual τ per "
                                        "sample, v3 (RGCL-g) learnable τ with the robust term ρ.")
    mode: Mode = option("fastclip", doc="Distributed mode: gather (OpenCLIP), disco (DisCo-CLIP), ring (Inf-CL) "
                                        "or fastclip (no feature-gradient communication; FastCLIP's only mode). "
                                        "siglip: gather, ring or fastclip.")
    backend: Backend = option("auto", doc="Tiled-loss kernels: auto (triton on CUDA, else torch), torch, triton "
                                          "or naive (full matrix, for tests).")
    tau_init: float = option(0.07, gt=0, doc="Initial temperature τ: the model's logit scale starts at "
                                             "log(1/τ); v2: every sample's initial τ. siglip: see "
                                             "siglip_scale_init.")
    learn_tau: bool = option(True, doc="openclip, siglip, neuclip: learn τ (true) or keep it at tau_init (false). FastCLIP "
                                       "fixes this by version (v0, v3 learn it; v1 keeps it; v2 per sample).")
    lr_tau: float | None = option(None, doc="Learning rate of τ: the logit-scale group's (openclip, v0, v3, neuclip; "
                                            "empty: the model lr) or v2's per-sample rule's (empty: 1e-2).")
    lr_tau_schedule: TauLrSchedule = option(
        "cosine", doc="Schedule of the logit-scale group's lr: cosine (as the model's), const, or step_thresh "
                      "(lr_tau, divided by 3 once τ <= 0.03: the reference's v3 rule).")
    gamma_min: float = option(0.2, gt=0, le=1, doc="FastCLIP's final inner learning rate γ (1 in epoch 0).")
    gamma_decay_epochs: int = option(18, ge=1, doc="Epochs over which γ decays from 1 to gamma_min.")
    gamma_schedule: GammaScheduleName = option("cosine", doc="γ schedule: cosine (per epoch), cosine_step "
                                                             "(per step) or constant (gamma_min after epoch 0).")
    # added after checkpoints recorded this section: omit_at_default keeps their records and hashes valid
    gamma_rule: GammaRule = option(
        "fixed", doc="FastCLIP's final γ: fixed (gamma_min) or drrho (DRRho-CLIP's README: min(1, 4.177·E^-0.7265) "
                     "with E = gamma_decay_epochs, which the trainer sets to the run's epochs unless given; "
                     "gamma_min is then unused).", omit_at_default=True)
    u_update: UUpdate = option(
        "moving_average", doc="FastCLIP v0/v1/v3 estimator update: moving_average (u ← (1−γ)u + γg) or scent (SCENT's "
                              "proximal mirror-descent step, per sample γ_i = σ(log(u_i+ε) + γ_s), with γ_s following "
                              "the γ schedule towards scent_gamma; docs/fastclip.md).",
        omit_at_default=True)
    scent_gamma: float = option(10.0, doc="u_update scent: the final offset γ_s of the per-sample step σ(log(u_i+ε) "
                                          "+ γ_s) (SCENT's published runs: 10 with gamma_schedule constant).",
                               omit_at_default=True)
    u_drift: Literal["none", "batch"] = option(
        "none", doc="FastCLIP v0/v1/v3: none (the reference's moving average) or batch: shift the batch's old "
                    "estimators by their mean log(g/u_old) before averaging, removing the drift they share since "
                    "their last visit (docs/fastclip.md).")
    rho: float = option(8.0, ge=0, doc="ρ of the robust losses (v2, v3, neuclip).")
    eps: float = option(1e-14, gt=0, doc="ε added to the estimators u in the surrogate's denominators (neuclip: "
                                         "the ε of log(ε + g)).")
    tau_min: float = option(0.01, gt=0, doc="v2: lower clamp of the per-sample τ.")
    tau_max: float = option(1.0, gt=0, doc="v2: upper clamp of the per-sample τ.")
    tau_grad_clamp: float = option(5.0, gt=0, doc="v2: the per-sample τ gradient is clipped to ±this.")
    tau_beta1: float = option(0.9, ge=0, doc="v2: first-moment decay of the per-sample τ rule "
                                                   "(0 in epoch 0).")
    tau_beta2: float = option(0.999, ge=0, doc="v2: second-moment decay of the per-sample τ rule.")
    tau_eps: float = option(1e-8, gt=0, doc="v2: denominator ε of the per-sample τ rule (added to v̂, not √v̂, "
                                            "as the reference).")
    neuclip: NeuCLIPConfig = option(factory=NeuCLIPConfig, doc="NeuCLIP's normaliser network (kind neuclip).")
    drrho: DRRhoConfig = option(factory=DRRhoConfig, doc="DRRho-CLIP's reference term (kind drrho).",
                                omit_at_default=True)
    distill: DistillConfig = option(factory=DistillConfig, omit_at_default=True,
                                    doc="Distillation from the training set's reference model (kind distill): "
                                        "the KL's weight λ and the teacher's τ.")

    siglip_scale_init: float = option(10.0, gt=0, doc="siglip: initial scale t = exp(logit_scale) of a model "
                                                       "trained from scratch (SigLIP: 10; replaces tau_init).")
    siglip_bias_init: float = option(-10.0, doc="siglip: initial learnable logit bias b (SigLIP: -10), saved in "
                                                "the model's open_clip config as init_logit_bias.")

    def __post_init__(self) -> None:
        registry.spec(self.kind).check_mode(self.mode)  # unknown kinds and modes it lacks, named
        if self.u_drift != "none" and (self.kind != "fastclip" or self.version == "v2"):
            raise ValueError(f"u_drift: {self.u_drift} applies to FastCLIP v0, v1 and v3 (their estimators u); "
                             f"this objective is {self.name}")
        self._check_estimator_rules()
        for name in ("tau_beta1", "tau_beta2"):  # bias correction divides by 1 − β^(epoch+1)
            if not getattr(self, name) < 1:
                raise ValueError(f"{name} must be < 1, got {getattr(self, name)}")
        if self.tau_min > self.tau_max:
            raise ValueError(f"tau_min ({self.tau_min}) must not exceed tau_max ({self.tau_max})")

    def _check_estimator_rules(self) -> None:
        """gamma_rule and u_update change FastCLIP's estimators u; refuse them where they do not apply."""
        if self.gamma_rule != "fixed" and self.kind not in ("fastclip", "drrho"):  # drrho: FastCLIP's γ, its rule
            raise ValueError(f"gamma_rule: {self.gamma_rule} applies to FastCLIP's γ; this objective is {self.name}")
        if self.u_update != "moving_average" and (self.kind != "fastclip" or self.version == "v2"):
            raise ValueError(f"u_update: {self.u_update} applies to FastCLIP v0, v1 and v3 (their estimators u); "
                             f"this objective is {self.name}")
        if self.u_update == "scent" and self.gamma_rule != "fixed":
            raise ValueError(f"gamma_rule: {self.gamma_rule} sets the moving average's γ, which u_update: scent "
                             "replaces by its per-sample step (set scent_gamma instead)")

    @property
    def name(self) -> str:
        """The CLI's ``--loss`` name of the objective (openclip, fastclip-vN, ...)."""
        for name, fields in registry.loss_names().items():
            if fields["kind"] == self.kind and all(getattr(self, k) == v for k, v in fields.items()):
                return name
        return self.kind

    @property
    def initial_tau(self) -> float:
        """τ = 1/t the model's logit scale starts from when trained from scratch (siglip: 1/siglip_scale_init)."""
        return registry.spec(self.kind).initial_tau(self)

    @property
    def init_logit_bias(self) -> float | None:
        """The learnable logit bias the model needs (open_clip's ``init_logit_bias``), None for none."""
        return registry.spec(self.kind).init_logit_bias(self)

    @property
    def learns_logit_scale(self) -> bool:
        """Whether the model's global logit scale p is trained (v2's per-sample τ lives in the loss)."""
        return registry.spec(self.kind).learns_logit_scale(self)


def loss_fields(name: str) -> dict[str, str]:
    """``--loss NAME`` (openclip, fastclip-v0 ... fastclip-v3, ...) -> LossConfig fields {kind[, version]}."""
    return dict(registry.spec_of_name(name)[1])


def __getattr__(attr: str):
    """``LOSS_NAMES``: the --loss names registered when it is read (not captured at import)."""
    if attr == "LOSS_NAMES":
        return tuple(registry.loss_names())
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
