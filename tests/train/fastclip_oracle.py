"""A float64 oracle of the reference FastCLIP step, written from the reference's structure (not ours).

It simulates the reference's K ranks literally: each rank's loss1 (its anchors, all negatives, features
gathered without grad except its own) and loss2 (all anchors, its negatives, similarities from its own
features), the per-rank loss, DDP's mean over ranks, plain autograd on full float64 matrices, and the
tables in the linear domain (u, not log u). Imported by the other FastCLIP tests; its own tests check
the oracle (rank-count invariance; the reference overflows in fp32 at τ = 0.01).
"""

from __future__ import annotations

import torch

RESET = 1e-35


def _mask(rows: int, cols: int, offset: int, transpose: bool = False) -> torch.Tensor:
    m = torch.ones(rows, cols, dtype=torch.float64)
    for i in range(rows):
        if transpose:
            if 0 <= i - offset < cols:
                m[i, i - offset] = 0.0
        elif 0 <= i + offset < cols:
            m[i, i + offset] = 0.0
    return m


def _ema(u_old, g, gamma, factor=None):
    carried = u_old if factor is None else u_old * factor
    u = (1.0 - gamma) * carried + gamma * g
    if gamma < 1.0:
        bad = (u_old < RESET) | torch.isinf(u_old) | torch.isnan(u_old)
        u = torch.where(bad, g, u)
    return u


class Oracle:
    """Reference-semantics FastCLIP over ``n`` samples; ``step`` returns (value, value_pre) and leaves
    .grad on the given leaf tensors. Tables: u_im, u_tt (+ v2: tau_*, bound_*, m_*, v_*), float64."""

    def __init__(
        self,
        version,
        n,
        *,
        rho=8.0,
        eps=1e-14,
        tau_init=0.07,
        lr_tau=1e-2,
        beta1=0.9,
        beta2=0.999,
        eps_tau=1e-8,
        dtype=torch.float64,
    ):
        self.version, self.rho, self.eps = version, rho, eps
        self.lr_tau, self.beta1, self.beta2, self.eps_tau = lr_tau, beta1, beta2, eps_tau
        z = torch.zeros(n, dtype=dtype)
        self.u_im, self.u_tt = z.clone(), z.clone()
        self.tau_im, self.tau_tt = z + tau_init, z + tau_init
        self.bound_im, self.bound_tt = z.clone(), z.clone()
        self.m_im, self.m_tt, self.v_im, self.v_tt = z.clone(), z.clone(), z.clone(), z.clone()
        self.epoch, self.gamma = 0, 1.0

    def _local(self, k, b, X, Y, idx, a):
        """Rank k's loss1 terms and table updates (global temperature)."""
        B = X.shape[0]
        rows = slice(k * b, (k + 1) * b)
        x, y = X[rows], Y[rows]
        sim_im, sim_tt = x @ Y.detach().T, y @ X.detach().T
        diag = (x * y).sum(1, keepdim=True)
        mask = _mask(b, B, k * b).to(x.dtype)
        l1_im = (torch.exp((sim_im - diag) * a) * mask).sum(1) / (B - 1)
        l1_tt = (torch.exp((sim_tt - diag) * a) * mask).sum(1) / (B - 1)
        ids = idx[rows]
        u_im = _ema(self.u_im[ids], l1_im.detach(), self.gamma)
        u_tt = _ema(self.u_tt[ids], l1_tt.detach(), self.gamma)
        return l1_im, l1_tt, u_im, u_tt, sim_im, sim_tt

    def _loss2(self, k, b, X, Y, sim_im, sim_tt, scale_im, scale_tt, bounds=None):
        """Rank k's loss2: every anchor against rank k's negatives, from rank k's similarities."""
        B = X.shape[0]
        diag = (X.detach() * Y.detach()).sum(1, keepdim=True)
        d_im = (sim_tt.T - diag) * scale_im
        d_tt = (sim_im.T - diag) * scale_tt
        if bounds is not None:
            d_im, d_tt = d_im - bounds[0], d_tt - bounds[1]
        mask = _mask(B, b, k * b, transpose=True).to(X.dtype)
        rws = (B - 1) if B <= b else b * (B - 1) / B
        return (torch.exp(d_im) * mask).sum(1) / rws, (torch.exp(d_tt) * mask).sum(1) / rws

    def step(self, X, Y, idx, p, num_ranks=1):
        B = X.shape[0]
        b = B // num_ranks
        if self.version == "v2":
            return self._step_v2(X, Y, idx, num_ranks)
        a = p.exp() if self.version != "v1" else p.detach().exp()
        local = [self._local(k, b, X, Y, idx, a) for k in range(num_ranks)]
        for k, (_, _, u_im, u_tt, _, _) in enumerate(local):
            self.u_im[idx[k * b : (k + 1) * b]] = u_im
            self.u_tt[idx[k * b : (k + 1) * b]] = u_tt
        ru_im, ru_tt = torch.cat([t[2] for t in local]), torch.cat([t[3] for t in local])
        total, pre = 0.0, 0.0
        for k, (l1_im, l1_tt, u_im, u_tt, sim_im, sim_tt) in enumerate(local):
            l2_im, l2_tt = self._loss2(k, b, X, Y, sim_im, sim_tt, a, a)
            loss = (
                (l1_im / (u_im + self.eps) + l1_tt / (u_tt + self.eps)).mean()
                + (l2_im / (ru_im + self.eps) + l2_tt / (ru_tt + self.eps)).mean()
            ) / 2
            if self.version == "v3":
                loss = loss / a.detach() + self.rho / a + (torch.log(u_im) + torch.log(u_tt)).mean() / 2 / a
            total = total + loss / num_ranks
            pre = pre + (l1_im / (u_im + self.eps) + l1_tt / (u_tt + self.eps)).detach().mean() / num_ranks
        total.backward()
        return total.detach(), pre

    def _local_v2(self, k, b, X, Y, idx):
        B = X.shape[0]
        rows = slice(k * b, (k + 1) * b)
        ids = idx[rows]
        x, y = X[rows], Y[rows]
        sim_im, sim_tt = x @ Y.detach().T, y @ X.detach().T
        diag = (x * y).sum(1, keepdim=True)
        out = {"sim_im": sim_im, "sim_tt": sim_tt}
        for side, sim in (("im", sim_im), ("tt", sim_tt)):
            tau = getattr(self, f"tau_{side}")[ids]
            b_old = getattr(self, f"bound_{side}")[ids]
            diff = (sim - diag) * (1.0 / tau)[:, None]
            b_new = torch.maximum(b_old, diff.detach().max(1).values)
            e = torch.exp(diff - b_new[:, None]) * _mask(b, B, k * b)
            l1 = e.sum(1) / (B - 1)
            u = _ema(getattr(self, f"u_{side}")[ids], l1.detach(), self.gamma, torch.exp(b_old - b_new))
            grad = (
                -(e * (diff - b_new[:, None] + b_new[:, None])).sum(1).detach() / (u + self.eps) / (B - 1)
                + torch.log(u + self.eps)
                + b_new
                + self.rho
            ).clamp(-5.0, 5.0)
            b1, b2 = (self.beta1, self.beta2) if self.epoch > 0 else (0.0, 0.0)
            m = b1 * getattr(self, f"m_{side}")[ids] + (1 - b1) * grad
            v = b2 * getattr(self, f"v_{side}")[ids] + (1 - b2) * grad**2
            m_hat, v_hat = m / (1 - b1 ** (self.epoch + 1)), v / (1 - b2 ** (self.epoch + 1))
            tau_new = (tau - self.lr_tau * m_hat / (v_hat + self.eps_tau)).clamp(0.01, 1.0)
            out[side] = {"l1": l1, "u": u, "tau": tau_new, "bound": b_new, "m": m, "v": v}
        return out

    def _step_v2(self, X, Y, idx, num_ranks):
        B = X.shape[0]
        b = B // num_ranks
        local = [self._local_v2(k, b, X, Y, idx) for k in range(num_ranks)]
        for k, loc in enumerate(local):
            ids = idx[k * b : (k + 1) * b]
            for side in ("im", "tt"):
                for name in ("u", "tau", "bound", "m", "v"):
                    getattr(self, f"{name}_{side}")[ids] = loc[side][name].detach()
        allv = {
            f"{n}_{s}": torch.cat([loc[s][n] for loc in local])
            for n in ("u", "tau", "bound")
            for s in ("im", "tt")
        }
        total, pre = 0.0, 0.0
        for k, loc in enumerate(local):
            l2_im, l2_tt = self._loss2(
                k,
                b,
                X,
                Y,
                loc["sim_im"],
                loc["sim_tt"],
                (1.0 / allv["tau_im"])[:, None],
                (1.0 / allv["tau_tt"])[:, None],
                bounds=(allv["bound_im"][:, None], allv["bound_tt"][:, None]),
            )
            p1 = loc["im"]["l1"] / (loc["im"]["u"] + self.eps) + loc["tt"]["l1"] / (loc["tt"]["u"] + self.eps)
            p2 = l2_im / (allv["u_im"] + self.eps) + l2_tt / (allv["u_tt"] + self.eps)
            total = total + (p1.mean() + p2.mean()) / 2 / num_ranks
            pre = pre + p1.detach().mean() / num_ranks
        total.backward()
        return total.detach(), pre

    def set_epoch(self, epoch, gamma):
        self.epoch, self.gamma = epoch, gamma


def make_batch(gen, b, d, dtype=torch.float64, spread=1.0):
    x = torch.nn.functional.normalize(torch.randn(b, d, generator=gen, dtype=torch.float64) * spread, dim=1)
    y = torch.nn.functional.normalize(x + 0.7 * torch.randn(b, d, generator=gen, dtype=torch.float64), dim=1)
    return x.to(dtype), y.to(dtype)


def make_loss(
    version: str,
    data_size: int,
    *,
    group=None,
    table_dtype=torch.float32,
    share_tables: bool = True,
    **loss_fields,
):
    """Our FastCLIPLoss for ``version`` with ``LossConfig`` keys ``loss_fields`` (the tests' one constructor;
    FastCLIP's knobs such as ``gamma_min`` by name, put into the ``fastclip`` section:
    trainkit.fastclip_section)."""
    from trainkit import fastclip_section

    from toolkit.core.config import build
    from toolkit.train.losses.config import LossConfig
    from toolkit.train.losses.fastclip.loss import FastCLIPLoss

    cfg = build(
        LossConfig,
        fastclip_section({"kind": "fastclip", "version": version, **loss_fields}),
        source="make_loss",
    )
    return FastCLIPLoss(cfg, data_size, group, table_dtype=table_dtype, share_tables=share_tables)
