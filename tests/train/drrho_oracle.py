"""A float64 oracle of DRRho-CLIP written from the paper's formula, not from cliptk's code: full B×B matrices
of the student's and the reference's similarities, the estimators in the linear domain (u, not log u), plain
autograd. Shared by test_drrho.py and test_drrho_dist.py.

    δ_ij = (s_ij − s_ii) − β (r_ij − r_ii)    (ℓ(θ; x_i, y_j) − ℓ(θ_ref; x_i, y_j); text anchors:
                                              the transpose)
    g1_i = 1/(B−1) Σ_{j≠i} exp(δ_ij / τ), g2_i likewise over column i;  u ← (1−γ)u + γg (first visit: u = g)
    F = τ̄·(1/B) Σ_i [g1_i/(u1_i+ε) + g2_i/(u2_i+ε)] + ρτ + τ/2·mean(log u1 + log u2),
        τ̄ = τ held fixed, u fixed
"""

from __future__ import annotations

import torch

RESET = 1e-35


def _ema(u_old: torch.Tensor, g: torch.Tensor, gamma: float) -> torch.Tensor:
    if gamma >= 1.0:
        return g.clone()
    u = (1.0 - gamma) * u_old + gamma * g
    bad = (u_old < RESET) | torch.isinf(u_old) | torch.isnan(u_old)
    return torch.where(bad, g, u)


class DRRhoOracle:
    """Tables u_im, u_tt over ``n`` samples (float64, start at 0); ``step`` returns F and leaves .grad on the
    leaves x, y (features [B, d]) and p (the logit scale's parameter, a = exp(p))."""

    def __init__(self, n: int, *, rho: float, eps: float, ref_weight: float = 1.0):
        self.rho, self.eps, self.beta = rho, eps, ref_weight
        self.u_im = torch.zeros(n, dtype=torch.float64)
        self.u_tt = torch.zeros(n, dtype=torch.float64)
        self.gamma = 1.0

    def step(self, x, y, xr, yr, ids, p):
        B = x.shape[0]
        a = p.exp()
        s, r = x @ y.T, xr.double() @ yr.double().T  # the reference rows exactly, in float64
        off = ~torch.eye(B, dtype=torch.bool)
        delta_im = (s - s.diag()[:, None]) - self.beta * (r - r.diag()[:, None])
        delta_tt = (s.T - s.diag()[:, None]) - self.beta * (r.T - r.diag()[:, None])
        g1 = torch.where(off, torch.exp(a * delta_im), 0.0).sum(1) / (B - 1)
        g2 = torch.where(off, torch.exp(a * delta_tt), 0.0).sum(1) / (B - 1)
        u1 = _ema(self.u_im[ids], g1.detach(), self.gamma)
        u2 = _ema(self.u_tt[ids], g2.detach(), self.gamma)
        self.u_im[ids], self.u_tt[ids] = u1, u2
        tau_fixed = 1.0 / a.detach()
        surrogate = (g1 / (u1 + self.eps) + g2 / (u2 + self.eps)).mean()
        value = tau_fixed * surrogate + self.rho / a + (u1.log() + u2.log()).mean() / (2 * a)
        value.backward()
        return value.detach()
