"""The one place the distributed modes reach the contrastive LSE kernels (``toolkit.kernels``).

Every mode evaluates the same two primitives on [b, d] × [n, d] blocks with one scalar scale ``a``
for rows and columns (open_clip's ``logit_scale.exp()``); see ``toolkit/kernels/__init__.py``.
``backend``: ``auto`` (Triton for CUDA tensors when it imports, else chunked torch tiles), ``torch``,
``triton`` or ``naive`` (full matrix), as in ``toolkit.kernels``.
"""

from __future__ import annotations

from torch import Tensor

from toolkit.kernels import BACKENDS
from toolkit.kernels import lse_backward as _lse_backward
from toolkit.kernels import lse_forward as _lse_forward

__all__ = ["BACKENDS", "lse_backward", "lse_forward"]


def lse_forward(x: Tensor, y: Tensor, scale: Tensor, *, compute_row: bool = True, compute_col: bool = True,
                backend: str = "auto") -> tuple[Tensor | None, Tensor | None]:
    """(row LSE [M] over y, column LSE [N] over x) of scale·x yᵀ, fp32 (fp64 for fp64 inputs); no autograd."""
    return _lse_forward(x, y, scale, scale, None, compute_row, compute_col, backend=backend)


def lse_backward(x: Tensor, y: Tensor, scale: Tensor, row_lse: Tensor | None, col_lse: Tensor | None,
                 grad_row: Tensor | None, grad_col: Tensor | None, *, backend: str = "auto"
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx [M, d], dy [N, d], d_scale per row [M], d_scale per column [N]) for the given (possibly global)
    LSEs and upstream gradients; fp32 (fp64 for fp64 inputs)."""
    return _lse_backward(x, y, scale, scale, row_lse, col_lse, grad_row, grad_col, None, backend=backend)
