"""Tiled contrastive log-sum-exp: the primitive every contrastive loss in cliptk is built from.

Imports only torch (and triton, lazily). Notation: x [M, D] image rows, y [N, D] text rows,
s_ij = <x_i, y_j> accumulated in fp32 (inputs fp32/bf16/fp16; fp64 stays fp64 for oracles),
row_scale [M] (or 0-d, broadcast) and col_scale [N] (or 0-d) multiplicative scales (1/τ).

- ``lse_forward`` -> (row_lse [M], col_lse [N]), fp32:
      row_lse_i = log Σ_{j not masked} exp(row_scale_i · s_ij)
      col_lse_j = log Σ_{i not masked} exp(col_scale_j · s_ij)
  ``diag_offset=k`` masks the entries with j == i + k out of both sums (k=0: the diagonal; the
  distributed modes pass rank·b). A fully masked row gives -inf.
- ``lse_backward`` -> (dx [M, D], dy [N, D], d_row_scale [M], d_col_scale [N]) in fp32, given the
  LSEs and their upstream gradients grad_row [M] / grad_col [N] (None = zero). With
  P_ij = exp(row_scale_i s_ij − row_lse_i), Q_ij = exp(col_scale_j s_ij − col_lse_j), mask → 0:
      dL/ds_ij = grad_row_i·row_scale_i·P_ij + grad_col_j·col_scale_j·Q_ij
      dx = (dL/ds) y,  dy = (dL/ds)ᵀ x,
      d_row_scale_i = grad_row_i Σ_j P_ij s_ij,  d_col_scale_j = grad_col_j Σ_i Q_ij s_ij.
  The LSEs may be *global* (over more columns/rows than this x, y block): the formulas then give this
  block's share of the gradient, which is how the ring mode accumulates across ranks.
- ``tiled_lse``: autograd wrapper of the two (gradients to x, y and both scales).
- ``clip_loss``: the symmetric CLIP loss, same value and gradients as open_clip's ClipLoss.
- ``siglip_loss``: the sigmoid (SigLIP) loss, same value and gradients as open_clip's SigLipLoss, tiled
  (``toolkit/kernels/siglip/``; ``sigmoid_sums`` is its block primitive for the distributed modes).
- ``accumulation_dtype`` / ``clip_value``: the dtype every loss accumulates in and the CLIP value
  ½ mean(r − a·s_ii) + ½ mean(c − a·s_ii) from LSEs, shared with the training losses.

Backends (keyword ``backend``): ``naive`` (full matrix, tests/benchmarks), ``torch`` (chunked PyTorch,
``toolkit/kernels/tiled.py``), ``triton`` (``toolkit/kernels/triton_lse.py``), ``auto`` (triton for CUDA
tensors when triton imports, else torch). ``block_size`` overrides the tile height; ``input_precision``
("ieee" | "tf32") picks the triton fp32 dot (None follows ``torch.get_float32_matmul_precision()``).
See docs/kernels.md.
"""

from __future__ import annotations

from toolkit.kernels.api import (
    BACKENDS,
    ClipLossFn,
    TiledLSE,
    as_scale,
    clip_loss,
    lse_backward,
    lse_forward,
    resolve_backend,
    tiled_lse,
    triton_available,
)
from toolkit.kernels.common import accumulation_dtype, clip_value
from toolkit.kernels.naive import clip_loss as naive_clip_loss
from toolkit.kernels.naive import lse_backward as naive_lse_backward
from toolkit.kernels.naive import lse_forward as naive_lse_forward
from toolkit.kernels.siglip import SigLIPLossFn, SigmoidSums, naive_siglip_loss, siglip_loss, sigmoid_sums

__all__ = [
    "BACKENDS",
    "ClipLossFn",
    "TiledLSE",
    "accumulation_dtype",
    "as_scale",
    "clip_loss",
    "clip_value",
    "lse_backward",
    "lse_forward",
    "naive_clip_loss",
    "naive_lse_backward",
    "naive_lse_forward",
    "naive_siglip_loss",
    "resolve_backend",
    "SigLIPLossFn",
    "SigmoidSums",
    "sigmoid_sums",
    "siglip_loss",
    "tiled_lse",
    "triton_available",
]
