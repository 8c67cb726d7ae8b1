"""Full-matrix sigmoid (SigLIP) sums: the ``naive`` backend and float64 reference (O(M·N) memory).

This module fixes the contract every backend implements (see ``toolkit/kernels/siglip/__init__.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.functional import logsigmoid

from toolkit.kernels.common import accumulation_dtype
from toolkit.kernels.siglip.common import SigmoidSums


def labels(m: int, n: int, pos_offset: int | None, dtype: torch.dtype, device) -> Tensor:
    """z [M, N]: +1 where j == i + pos_offset (the positive pairs), −1 elsewhere (all −1 for None)."""
    z = -torch.ones(m, n, dtype=dtype, device=device)
    if pos_offset is not None:
        i = torch.arange(m, device=device)[:, None]
        j = torch.arange(n, device=device)[None, :]
        z[j == i + pos_offset] = 1.0
    return z


def sigmoid_sums(
    x: Tensor,
    y: Tensor,
    scale: Tensor,
    bias: Tensor,
    pos_offset: int | None,
    compute_dx: bool,
    compute_dy: bool,
) -> SigmoidSums:
    """loss = −Σ_ij log σ(z_ij (t·s_ij + b)) and its gradients, from the whole matrix (explicit formulas:
    ∂loss/∂u_ij = σ(u_ij) − [z_ij = +1] with u = t·s + b). Scale and bias gradients come with any side."""
    acc = accumulation_dtype(x)
    xa, ya, t, b = x.to(acc), y.to(acc), scale.to(acc), bias.to(acc)
    s = xa @ ya.T
    u = t * s + b
    z = labels(s.shape[0], s.shape[1], pos_offset, acc, s.device)
    loss = -logsigmoid(z * u).sum()
    if not (compute_dx or compute_dy):
        return SigmoidSums(loss, None, None, None, None)
    g = torch.sigmoid(u) - (z > 0).to(acc)  # ∂loss/∂u
    dx = t * (g @ ya) if compute_dx else None
    dy = t * (g.T @ xa) if compute_dy else None
    return SigmoidSums(loss, dx, dy, (g * s).sum(), g.sum())


def siglip_loss(image_features: Tensor, text_features: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """open_clip's ``SigLipLoss`` on one process, by plain autograd: −Σ log σ(z ⊙ (t·x yᵀ + b)) / B."""
    logits = scale * image_features @ text_features.T
    if bias is not None:
        logits = logits + bias
    z = labels(logits.shape[0], logits.shape[1], 0, logits.dtype, logits.device)
    return -logsigmoid(z * logits).sum() / image_features.shape[0]
