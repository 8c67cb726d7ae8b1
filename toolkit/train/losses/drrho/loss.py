"""``DRRhoLoss``: DRRho-CLIP (arXiv 2505.06699, Optimization-AI/DRRho-CLIP) on FastCLIP's estimators.

Per global batch (B pairs; student rows x_i, y_i [d]; the reference model's cached rows x^r_i, y^r_i [d_ref];
s_ij = <x_i, y_j>, r_ij = <x^r_i, y^r_j>; a = exp(p) = 1/τ; β = ``loss.drrho.ref_weight``, 1 in the paper):

    excess pairwise loss   δ_ij = (s_ij − s_ii) − β (r_ij − r_ii)          ℓ(θ, z) − ℓ(θ_ref, z), per pair
    g1_i = 1/(B−1) Σ_{j≠i} exp(a δ_ij),   g2_i = 1/(B−1) Σ_{j≠i} exp(a δ_ji)   (the text anchor's column)
    u ← (1−γ)u + γg (FastCLIP's tables, first-visit rule),
    value  F = τ·(1/B) Σ_i [g1_i/(u1_i+ε) + g2_i/(u2_i+ε)] + ρτ + τ/2·mean(log u1 + log u2)
    gradient = ∇F with u and the leading τ held fixed (its p-gradient includes ρτ and the log u term).

**Tiling without a B×B reference matrix.** δ_ij = <x̃_i, ỹ_j> − <x̃_i, ỹ_i> for the widened rows
x̃_i = [x_i, x^r_i] and ỹ_j = [y_j, −β y^r_j] [d + d_ref], so DRRho's g is FastCLIP's g of the widened rows,
and every FastCLIP piece serves unchanged: the tiled LSE kernels (torch chunked and Triton: no B×B matrix,
linear memory), the log-domain estimators and tables, the fastclip mode (one all_gather of the widened pairs,
no feature-gradient traffic). The widened rows' gradient flows to x and y through the concatenation; the
reference's columns get none (its features are data). a·<x̃, ỹ> = a·(s − β r), so a's gradient is exact too.

**Gradient scale.** The authors' code (``SogCLRLoss``: its all_gather carries gradients, no loss1/loss2 split)
gives the features τ·∇(1/B) Σ_i [g1_i/U1_i + g2_i/U2_i]: twice FastCLIP v3's (``fastclip/loss.py``), whose
p-gradient it equals. Its published learning rates assume that, so the feature gradients here are FastCLIP
v3's doubled: the gradient of F above. (Two differences left as they are, both below 1/B relative: the code's
estimator averages over B, not B−1, and adds ε inside the moving average; docs/objectives.md.)

Which ranks call it: every rank of ``group``, each step, with the same local batch b; ``reference`` holds this
rank's rows of the reference features (the trainer passes them when ``reads_reference``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

import torch
from torch import Tensor

from toolkit.train.losses.base import reference_rows
from toolkit.train.losses.config import LossConfig
from toolkit.train.losses.fastclip.estimators import GlobalBatch
from toolkit.train.losses.fastclip.loss import FastCLIPLoss


def widen(
    image_features: Tensor, text_features: Tensor, reference: tuple[Tensor, Tensor] | None, ref_weight: float
) -> tuple[Tensor, Tensor]:
    """(x̃ = [x, x^r], ỹ = [y, −β y^r]) [b, d + d_ref] in the promoted dtype of the features and the
    reference's (bf16 features with a bf16 reference stay bf16, the Triton backend's fast path; with a float32
    reference they become float32), differentiable in x and y. Checks the reference (``reference_rows``) and
    its device."""
    ref_image, ref_text = reference_rows(reference, image_features.shape[0], "drrho")
    if ref_image.device != image_features.device:
        raise ValueError(
            f"drrho: reference features on {ref_image.device}, student features on {image_features.device}"
        )
    acc = torch.promote_types(
        image_features.dtype, ref_image.dtype
    )  # FastCLIP accumulates in fp32 whatever it is
    ref_image, ref_text = ref_image.detach().to(acc), ref_text.detach().to(acc)
    x = torch.cat([image_features.to(acc), ref_image], 1)
    y = torch.cat([text_features.to(acc), ref_text * -ref_weight], 1)
    return x, y


class DRRhoLoss(FastCLIPLoss):
    """DRRho-CLIP's objective (module docstring) with FastCLIP v3's per-sample tables (log_u_image,
    log_u_text).

    ``cfg``: a ``LossConfig`` with kind drrho (its ``drrho`` section; τ, ρ, ε, γ schedule as FastCLIP's);
    ``data_size``, ``group``, ``table_dtype``, ``share_tables``, ``check_sizes`` as ``FastCLIPLoss``.
    """

    reads_reference: ClassVar[bool] = True

    def __init__(
        self,
        cfg: LossConfig,
        data_size: int,
        group=None,
        *,
        table_dtype: torch.dtype = torch.float32,
        share_tables: bool = True,
        check_sizes: bool = True,
    ):
        if cfg.kind != "drrho":
            raise ValueError(f"DRRhoLoss needs a LossConfig of kind drrho, got {cfg.kind!r}")
        if (
            cfg.fastclip.version != "v3"
        ):  # the estimator form is always v3's; another version would be silently ignored
            raise ValueError(
                "drrho builds on FastCLIP v3's estimators (loss.fastclip.version: v3), got "
                f"{cfg.fastclip.version!r}; "
                "a fixed τ is loss.learn_tau: false"
            )
        # FastCLIP's machinery checks its own kind: build it as v3, then keep the drrho config
        super().__init__(
            replace(cfg, kind="fastclip"),
            data_size,
            group,
            table_dtype=table_dtype,
            share_tables=share_tables,
            check_sizes=check_sizes,
        )
        self.cfg = cfg

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | None,
        index: Tensor,
        logit_bias: Tensor | None = None,
        reference: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """The global value (0-d, equal on every rank) carrying this rank's gradients; tables updated.

        image_features, text_features: [b, d] L2-normalised student features; logit_scale a = exp(p) (0-d);
        index: [b] dense sample ids; reference: (ref_image, ref_text) [b, d_ref], the reference model's
        L2-normalised features of the same rows (no gradient); logit_bias: unused."""
        if logit_scale is None:
            raise ValueError("drrho needs logit_scale (exp of the model's logit_scale)")
        x, y = widen(image_features, text_features, reference, self.cfg.drrho.ref_weight)
        return super().forward(x, y, logit_scale, index)

    def _global_step(self, batch: GlobalBatch, index: Tensor, old_rows: Tensor, logit_scale: Tensor):
        """FastCLIP v3's step on the widened batch; feature gradients doubled (module docstring), no
        p-gradient when τ is fixed (``learn_tau: false``)."""
        value, dx, dy, da = super()._global_step(batch, index, old_rows, logit_scale)
        return value, 2.0 * dx, 2.0 * dy, (da if self.cfg.learn_tau else None)
