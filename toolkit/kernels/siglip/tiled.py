"""Chunked PyTorch backend of the sigmoid loss (``backend="torch"``): the CPU path and the fallback.

The matrix u = t·x yᵀ + b is visited in row strips of ``block_size`` rows × all N columns (one matmul per
strip keeps CPU BLAS efficient). No normaliser couples the strips, so ONE sweep gives the loss and, when
asked, both feature gradients: per strip

    u = t·s + b                          (in place in the strip buffer)
    loss += Σ softplus(u) − Σ_pos u       (−log σ(−u) for negatives; the positives' softplus(−u) =
                                          softplus(u) − u)
    G = σ(u) − [pos]                      (∂loss/∂u, in place)
    dx[strip] = G Y,   dy += Gᵀ X[strip],  d_bias += Σ G

(the strip is computed as its transpose Y x_stripᵀ, see below) and after the sweep dx, dy are multiplied by t
once, and d_scale = Σ_ij G_ij s_ij = Σ_i ⟨x_i, (G Y)_i⟩ (an O(M·D) dot instead of another pass over the
strips). Memory: one strip buffer and one softplus temporary of the strip's size, plus the O((M + N)·D)
gradients.

Called by every rank on its own blocks; ``toolkit.kernels.siglip.api`` validated the shapes and made
scale and bias 0-d tensors of the accumulation dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.functional import softplus

from toolkit.kernels.siglip.common import SigmoidSums
from toolkit.kernels.tiled import _diag_index, strip_rows

# softplus(u) is exactly u above this (e^-40 = 4e-18 is below half an ulp of 40 in fp64), so the
# shortcut torch takes above ``threshold`` costs no precision, unlike its default of 20 (e^-20 = 2e-9).
SOFTPLUS_THRESHOLD = 40.0


def sigmoid_sums(
    x: Tensor,
    y: Tensor,
    scale: Tensor,
    bias: Tensor,
    pos_offset: int | None,
    compute_dx: bool,
    compute_dy: bool,
    block_size: int | None,
    compute_loss: bool = True,
) -> SigmoidSums:
    """Loss sum and gradients of x [M, D] against y [N, D] (module docstring); positives at
    j == i + pos_offset (None: every pair is a negative); ``compute_loss=False``: gradients only (loss 0)."""
    m, n = x.shape[0], y.shape[0]
    acc = scale.dtype
    xa, ya = x.to(acc), y.to(acc)
    grads = compute_dx or compute_dy
    dx = torch.empty(m, x.shape[1], dtype=acc, device=x.device) if compute_dx else None
    dy = torch.zeros(n, y.shape[1], dtype=acc, device=x.device) if compute_dy else None
    loss = torch.zeros((), dtype=acc, device=x.device)
    d_bias = torch.zeros((), dtype=acc, device=x.device)
    bm = strip_rows(m, n, block_size)
    # The strip is computed transposed, uᵀ = Y x_stripᵀ into an [N, rows] buffer, and used through its [rows,
    # N] view: MKL's sgemm packs a transposed right operand, so x_strip·Yᵀ cost a transient ~N·D·4/2 bytes
    # (17.5 MiB at N = 16,384, d = 512: more than the strip itself) and was ~25% slower on 2 cores.
    buf = torch.empty(n, min(bm, m), dtype=acc, device=x.device)
    for i0 in range(0, m, bm):
        i1 = min(m, i0 + bm)
        u = (
            torch.mm(ya, xa[i0:i1].T, out=buf[:, : i1 - i0]).T
            if i1 - i0 == buf.shape[1]
            else torch.mm(ya, xa[i0:i1].T).T
        )  # the last, shorter strip: its own (smaller) buffer
        torch.addcmul(bias, u, scale, out=u)  # u = t·s + b (same-position elementwise: safe in place)
        pos = _diag_index(i0, i1, n, pos_offset, x.device)
        if compute_loss:
            loss += softplus(u, threshold=SOFTPLUS_THRESHOLD).sum()
            if pos is not None:
                loss -= u[pos].sum()
        if not grads:
            continue
        g = torch.sigmoid(u, out=u)
        if pos is not None:
            g[pos] -= 1.0
        d_bias += g.sum()
        if compute_dx:
            torch.mm(g, ya, out=dx[i0:i1])
        if compute_dy:
            dy.addmm_(g.T, xa[i0:i1])
    if not grads:
        return SigmoidSums(loss, None, None, None, None)
    # Σ_ij G_ij s_ij from the un-scaled gradients: Σ_i ⟨x_i, (G Y)_i⟩ (or Σ_j ⟨y_j, (Gᵀ X)_j⟩), as ONE flat
    # dot: linalg.vecdot materialised the [M, D] product (32 MiB at B = 16,384, d = 512: a third of the
    # loss's own memory in benchmarks/loss/siglip_loss.py).
    feats, grad = (xa, dx) if compute_dx else (ya, dy)
    d_scale = torch.dot(feats.reshape(-1), grad.reshape(-1))
    return SigmoidSums(
        loss, None if dx is None else dx.mul_(scale), None if dy is None else dy.mul_(scale), d_scale, d_bias
    )
