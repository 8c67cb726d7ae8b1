"""What every sigmoid-loss backend returns (a leaf of ``toolkit.kernels.siglip``)."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class SigmoidSums(NamedTuple):
    """The summed sigmoid loss over one block and its gradients (not divided by any batch size).

    loss (0-d) = −Σ_ij log σ(z_ij (t·s_ij + b)); dx [M, D], dy [N, D] its gradients to x and y (None when
    not asked for); d_scale, d_bias (0-d) its gradients to t and b (None when neither side is asked for).
    All in the accumulation dtype (fp32; fp64 for fp64 inputs).
    """

    loss: Tensor
    dx: Tensor | None
    dy: Tensor | None
    d_scale: Tensor | None
    d_bias: Tensor | None
