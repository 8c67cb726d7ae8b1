"""Two definitions every contrastive loss in cliptk shares: the accumulation dtype and the CLIP value.

A leaf of ``toolkit.kernels`` (imports torch only), re-exported by the package so the training losses
use the same ones instead of restating them.
"""

from __future__ import annotations

import torch
from torch import Tensor


def accumulation_dtype(x: Tensor) -> torch.dtype:
    """fp32 for fp32/bf16/fp16 inputs, fp64 for fp64 inputs (the float64 oracles stay exact)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def clip_value(row_lse: Tensor, col_lse: Tensor, scale: Tensor, pos: Tensor) -> Tensor:
    """½ mean_i (r_i − a s_ii) + ½ mean_j (c_j − a s_jj) from row LSEs r [b], column LSEs c [b], the scale
    a (0-d) and the positive similarities s_ii [b]; 0-d in the LSEs' dtype. Differentiable in all inputs
    (autograd Functions call it in forward, where no graph is recorded)."""
    return 0.5 * (row_lse.mean() + col_lse.mean()) - scale.to(row_lse.dtype) * pos.mean()
