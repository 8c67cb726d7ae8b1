"""The sigmoid (SigLIP) loss, tile by tile: L = −(1/b) Σ_i Σ_j log σ(z_ij (t·s_ij + b)).

s_ij = ⟨x_i, y_j⟩ (accumulated in fp32; fp64 stays fp64), t the scale (t itself, open_clip's
``logit_scale.exp()``), b the learnable bias, z_ij = +1 for the positive pairs (j == i + pos_offset;
the diagonal for one process) and −1 otherwise. With u = t·s + b and G = σ(u) − [z = +1] (= ∂/∂u):

    ∂/∂x_i = t Σ_j G_ij y_j,   ∂/∂y_j = t Σ_i G_ij x_i,   ∂/∂t = Σ G_ij s_ij,   ∂/∂b = Σ G_ij

(all over b for the loss). Terms are softplus(−z u) (never the log of a sigmoid), exact at any |u|. No
normaliser couples the tiles, so ONE sweep gives the value and every gradient: the autograd Function
computes them in its forward and its backward only scales them by the upstream gradient.

- ``siglip_loss(image_features, text_features, scale, bias, backend=...)``: open_clip's ``SigLipLoss`` on
  one process (value and gradients to features, scale and bias), memory O(B·D).
- ``sigmoid_sums(x, y, scale, bias, pos_offset, compute_dx=, compute_dy=)``: the block primitive the
  distributed modes use (sums, not means; no autograd) -> ``SigmoidSums``.
- ``SigLIPLossFn``: the fused autograd Function (divides by a given row count: the local batch).

Backends as ``toolkit.kernels``: ``naive`` (full matrix, the float64 reference), ``torch`` (row strips,
``siglip/tiled.py``), ``triton`` (``siglip/triton_kernel.py``), ``auto``. See docs/kernels.md.
"""

from __future__ import annotations

from toolkit.kernels.siglip.api import SigLIPLossFn, siglip_loss, sigmoid_sums
from toolkit.kernels.siglip.common import SigmoidSums
from toolkit.kernels.siglip.naive import siglip_loss as naive_siglip_loss

__all__ = ["SigLIPLossFn", "SigmoidSums", "naive_siglip_loss", "sigmoid_sums", "siglip_loss"]
