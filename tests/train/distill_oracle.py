"""A float64 oracle of the distill objective, written from MobileCLIP's formula on full B×B matrices with
plain autograd (no toolkit code), and the inputs its tests share. Imported by bare name (tests/train).

    L = (1 − λ)·½(CE(a·S) + CE(a·Sᵀ)) + λ·½(mean_i KL(softmax_j(a_t T_i·) ‖ softmax_j(a S_i·))
                                       + mean_j KL(softmax_i(a_t T_·j) ‖ softmax_i(a S_·j)))

with S = x yᵀ (student), T = u vᵀ (teacher), a = exp(p), a_t = 1/τ_t.
"""

from __future__ import annotations

import torch
from torch.nn.functional import cross_entropy, log_softmax, normalize, softmax


def naive_distill(x, y, a, u, v, teacher_tau: float, weight: float):
    """The objective's value (0-d, float64 for float64 inputs), differentiable in x, y and a."""
    s, t = a * x @ y.T, (u @ v.T) / teacher_tau
    labels = torch.arange(s.shape[0])
    clip = 0.5 * (cross_entropy(s, labels) + cross_entropy(s.T, labels))
    kl_rows = (softmax(t, 1) * (log_softmax(t, 1) - log_softmax(s, 1))).sum(1).mean()
    kl_cols = (softmax(t, 0) * (log_softmax(t, 0) - log_softmax(s, 0))).sum(0).mean()
    return (1 - weight) * clip + weight * 0.5 * (kl_rows + kl_cols)


def unit_rows(n: int, d: int, gen: torch.Generator, near: torch.Tensor | None = None) -> torch.Tensor:
    """n L2-normalised float64 rows of width d; ``near`` [n, d]: each row near that one (paired data)."""
    rows = torch.randn(n, d, generator=gen, dtype=torch.float64)
    return normalize(rows if near is None else near + 0.7 * rows, dim=1)


def inputs(b: int, d: int, d_ref: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(x, y [b, d], u, v [b, d_ref], p): paired student and teacher features, a logit scale exp(p) near
    14."""
    gen = torch.Generator().manual_seed(seed)
    x = unit_rows(b, d, gen)
    u = unit_rows(b, d_ref, gen)
    y, v = unit_rows(b, d, gen, near=x), unit_rows(b, d_ref, gen, near=u)
    return (
        x,
        y,
        u,
        v,
        torch.tensor(2.64, dtype=torch.float64) + 0.1 * torch.randn((), generator=gen, dtype=torch.float64),
    )
