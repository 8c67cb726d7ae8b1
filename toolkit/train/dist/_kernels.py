"""The one place the distributed modes reach the contrastive LSE kernels (``toolkit.kernels``).

Every mode evaluates the same two primitives on [b, d] × [n, d] blocks with one scalar scale ``a``
for rows and columns (open_clip's ``logit_scale.exp()``); see ``toolkit/kernels/__init__.py``.

TODO(kernels): only the naive backend exists on this branch; when the kernels branch (public
``toolkit.kernels.lse_forward/lse_backward(..., backend=...)``) is merged, call those with ``backend``.
"""

from __future__ import annotations

from torch import Tensor

from toolkit.kernels.naive import lse_backward as _naive_backward
from toolkit.kernels.naive import lse_forward as _naive_forward

BACKENDS = ("auto", "naive")


def _check(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"kernels backend {backend!r} is not available here; choose one of {BACKENDS}")


def lse_forward(x: Tensor, y: Tensor, scale: Tensor, *, compute_row: bool = True, compute_col: bool = True,
                backend: str = "auto") -> tuple[Tensor | None, Tensor | None]:
    """(row LSE [M] over y, column LSE [N] over x) of scale·x yᵀ, fp32 (fp64 for fp64 inputs); no autograd."""
    _check(backend)
    return _naive_forward(x.detach(), y.detach(), scale.detach(), scale.detach(), None, compute_row, compute_col)


def lse_backward(x: Tensor, y: Tensor, scale: Tensor, row_lse: Tensor | None, col_lse: Tensor | None,
                 grad_row: Tensor | None, grad_col: Tensor | None, *, backend: str = "auto"
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx [M, d], dy [N, d], d_scale per row [M], d_scale per column [N]) for the given (possibly global)
    LSEs and upstream gradients; fp32 (fp64 for fp64 inputs)."""
    _check(backend)
    s = scale.detach()
    return _naive_backward(x.detach(), y.detach(), s, s, row_lse, col_lse, grad_row, grad_col, None)
