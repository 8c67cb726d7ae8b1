"""A float64 oracle of NeuCLIP, written from the paper's formulas with plain autograd on full matrices.

``Oracle`` keeps the prototypes W [2, m, d] (the first ``filled`` in use) and AdaGrad sums itself; ``step``
returns the value and leaves .grad on x, y, p: the gradient of

    τ/(2B) Σ_i [e^{−α1_i}(ε + g1_i) + α1_i − 1 + e^{−α2_i}(ε + g2_i) + α2_i − 1] + ρτ

with α from the prototypes, detached, fitted on the batch first (``fit_order`` before) or after
(``end_step``); ``fit`` takes the network's AdaGrad steps on
J(W) = 1/B Σ_i [e^{t_i − α_i(W)} + α_i(W)] by autograd on W (features, τ and t fixed). Imported by the
NeuCLIP tests (single process, distributed, trainer).
"""

from __future__ import annotations

import math

import torch

from toolkit.train.losses.neuclip.network import draw_rows


def similarities(x, y):
    """(S [B, B], off-diagonal mask [B, B]) in float64."""
    s = x @ y.T
    return s, 1.0 - torch.eye(s.shape[0], dtype=s.dtype)


def log_g(x, y, a):
    """(log g1 [B], log g2 [B]) by the definition (mean of exp(a(s_ij − s_ii)) over j ≠ i)."""
    s, mask = similarities(x, y)
    d = torch.diagonal(s)
    g1 = (torch.exp(a * (s - d[:, None])) * mask).sum(1) / (s.shape[0] - 1)
    g2 = (torch.exp(a * (s - d[None, :])) * mask).sum(0) / (s.shape[0] - 1)
    return g1.log(), g2.log()


def alphas(w, x, y, a, eps):
    """The network's predictions (α1, α2) [B] from prototypes w [2, m, d] (image side, text side)."""
    sii = (x * y).sum(1)
    out = []
    for side, f in enumerate((x, y)):
        unit = w[side] / w[side].norm(dim=1, keepdim=True)
        out.append(torch.log(eps + torch.exp(a * (f @ unit.T - sii[:, None])).mean(1)))
    return out


class Oracle:
    def __init__(
        self,
        num_prototypes,
        *,
        lr=0.05,
        inner_steps=2,
        restart_every_steps=0,
        rho=6.5,
        eps=1e-6,
        adagrad_eps=1e-10,
        learn_tau=True,
        fit_order="before",
    ):
        self.m, self.lr, self.inner, self.restart = num_prototypes, lr, inner_steps, restart_every_steps
        self.before = fit_order == "before"
        self.rho, self.eps, self.adagrad_eps, self.learn_tau = rho, eps, adagrad_eps, learn_tau
        self.w = self.sumsq = None
        self.filled, self.init_now = 0, False

    def _init(self, x, y, step):
        self.w = torch.zeros(2, self.m, x.shape[1], dtype=x.dtype)
        self.sumsq = torch.zeros_like(self.w)
        self.filled = 0
        self._grow(x, y, step)

    def _grow(self, x, y, step):
        """The next min(m − filled, B) prototypes from this batch (a start spread over ⌈m/B⌉ batches)."""
        num = min(self.m - self.filled, x.shape[0])
        if num > 0:
            rows = draw_rows(num, x.shape[0], step)
            self.w[:, self.filled : self.filled + num] = torch.stack([y.detach()[rows], x.detach()[rows]])
            self.filled += num

    def step(self, x, y, p, step):
        """Value (0-d) of the model step on the global batch x, y [B, d] (leaves, fp64), p (leaf, 0-d)."""
        self.init_now = self.w is None
        if self.init_now:
            self._init(x, y, step)
        a = p.exp()
        lg1, lg2 = log_g(x, y, a)
        self._last = (x.detach(), y.detach(), a.detach(), lg1.detach(), lg2.detach(), step)
        if self.before:  # the paper's order: the network first fits this batch
            self.fit()
        a1, a2 = alphas(self.w[:, : self.filled], x.detach(), y.detach(), a.detach(), self.eps)
        eps, tau, big_b = self.eps, 1 / a, x.shape[0]
        terms = (eps + lg1.exp()) * torch.exp(-a1) + a1 - 1 + (eps + lg2.exp()) * torch.exp(-a2) + a2 - 1
        value = tau * terms.sum() / (2 * big_b) + self.rho * tau
        value.backward()
        err = ((a1 - torch.log(eps + lg1.exp())).abs() + (a2 - torch.log(eps + lg2.exp())).abs()).mean() / 2
        return value.detach(), err.detach()

    def end_step(self):
        if not self.before:
            self.fit()

    def fit(self):
        """The network's update on the last batch (restart when due, else growth, then the AdaGrad steps)."""
        x, y, a, lg1, lg2, step = self._last
        if self.restart and step > 0 and step % self.restart == 0:
            self._init(x, y, step)
        elif not self.init_now:
            self._grow(x, y, step)
        used = slice(0, self.filled)
        targets = [torch.log(self.eps + lg.exp()) for lg in (lg1, lg2)]
        for _ in range(self.inner):
            w = self.w[:, used].clone().requires_grad_()
            j = sum(
                ((t - al).exp() + al).sum()
                for t, al in zip(targets, alphas(w, x, y, a, self.eps), strict=True)
            )
            (j / x.shape[0]).backward()
            self.sumsq[:, used] += w.grad**2
            self.w[:, used] -= self.lr * w.grad / (self.sumsq[:, used].sqrt() + self.adagrad_eps)


def unit_pairs(size, dim, gen, noise=0.8):
    """Correlated unit pairs (x, y) [size, dim] float64."""
    x = torch.nn.functional.normalize(torch.randn(size, dim, generator=gen, dtype=torch.float64), dim=1)
    y = torch.nn.functional.normalize(
        x + noise * torch.randn(size, dim, generator=gen, dtype=torch.float64), dim=1
    )
    return x, y


def p_of(tau):
    return math.log(1.0 / tau)
