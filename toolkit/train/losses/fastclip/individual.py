"""FastCLIP-v2: individual temperatures per sample and side (iSogCLR-style), as the reference does it.

Per anchor i of this rank (image side shown; the text side uses columns), with its old τ_i, bound b_i:
    z_ij = (s_ij − s_ii)/τ_i;  b_i ← max(b_i, max_j z_ij)  (j over all columns, the diagonal's 0 too)
    g̃_i = 1/(B−1) Σ_{j≠i} exp(z_ij − b_i);  ũ_i ← (1−γ)·ũ_i·e^{b_old − b_new} + γ·g̃_i  (first-visit rule)
    grad_i = clip_{±5}( −1/(B−1) Σ_{j≠i} e^{z_ij−b_i} z_ij / (ũ_i+ε) + log(ũ_i+ε) + b_i + ρ )
    m ← β1 m + (1−β1) grad;  v ← β2 v + (1−β2) grad²   (β1 = β2 = 0 in epoch 0)
    τ_i ← clip_[τ_min, τ_max]( τ_i − lr_tau · m̂ / (v̂ + eps_tau) ),  m̂ = m/(1−β1^{epoch+1}), v̂ likewise
The reference divides by v̂ + eps_tau, not √v̂ + eps_tau; reproduced as is.
Model gradient ½∇(1/B) Σ_i [g̃1_i/(ũ1_i+ε) + g̃2_i/(ũ2_i+ε)] with, as in the reference, the anchor side
(gradient through x_i for image anchors, through s_ii) computed with the pre-update τ and the
negative side (through the other modality's rows) with the post-update τ (the reference's loss2 uses
the gathered new τ and new bounds). The reported value is the surrogate with the pre-update τ (the
reference's value averages the pre- and post-update halves; only logging sees the difference).
"""

from __future__ import annotations

import torch
from torch import Tensor

from toolkit.kernels import lse_backward, lse_forward
from toolkit.train.losses.config import LossConfig
from toolkit.train.losses.fastclip.estimators import (
    GlobalBatch,
    check_unique,
    ema_log,
    gather_rows,
    log_plus_eps,
    row_max,
)
from toolkit.train.losses.fastclip.tables import SampleTables

SIDES = ("image", "text")
PER_SIDE = ("log_u", "tau", "bound", "m", "v")


# lr of the per-sample τ rule when LossConfig.lr_tau is empty (the reference's default for iSogCLR).
DEFAULT_LR_TAU = 1e-2


def table_columns(tau_init: float) -> dict[str, float]:
    """v2's extra columns and initial values (u's columns are added by the loss)."""
    return {f"{k}_{s}": (tau_init if k == "tau" else 0.0) for k in PER_SIDE[1:] for s in SIDES}


def _side_update(
    cfg: LossConfig, gamma: float, epoch: int, bt: GlobalBatch, old: dict[str, Tensor], rows: bool
):
    """One side's anchors on this rank: (new state dict, log g̃, d/d features of the anchor side).

    rows=True: image anchors, rows of S = x (this rank) @ yg.T; False: text anchors, columns of
    S = xg @ y (this rank).T (the same computation with the roles swapped).
    """
    acc, one = bt.x.dtype, torch.ones((), dtype=bt.x.dtype, device=bt.x.device)
    a_rows, a_cols = (bt.x, bt.yg) if rows else (bt.y, bt.xg)
    tau = old["tau"]
    scale = 1.0 / tau
    z_max = (row_max(a_rows, a_cols) - bt.sii) * scale
    bound = torch.maximum(old["bound"], z_max)
    lse, _ = lse_forward(a_rows, a_cols, scale, one, bt.off, True, False, backend=cfg.backend)
    log_g = lse.to(acc) - scale * bt.sii - bound - bt.log_bm1
    log_u = ema_log(old["log_u"], log_g, gamma, shift=old["bound"] - bound)
    den = log_plus_eps(log_u, cfg.eps)
    w = torch.full((bt.b,), 1.0 / (2 * bt.size), dtype=acc, device=bt.x.device)
    norm = scale * bt.sii + bound + bt.log_bm1 + den
    d_anchor, _, d_scale, _ = lse_backward(
        a_rows, a_cols, scale, one, norm, None, w, None, bt.off, backend=cfg.backend, compute_dy=False
    )
    r = (log_g - den).exp()
    sum_pz = scale * (
        d_scale.to(acc) / w - bt.sii * r
    )  # Σ_j P_ij z_ij with P_ij = e^{z_ij−b_i}/((B−1)(ũ_i+ε))
    rule = cfg.fastclip  # v2's per-sample τ rule
    grad = (-sum_pz + den + bound + cfg.rho).clamp(-rule.tau_grad_clamp, rule.tau_grad_clamp)
    beta1, beta2 = (rule.tau_beta1, rule.tau_beta2) if epoch > 0 else (0.0, 0.0)
    m = beta1 * old["m"] + (1.0 - beta1) * grad
    v = beta2 * old["v"] + (1.0 - beta2) * grad**2
    m_hat = m / (1.0 - beta1 ** (epoch + 1))
    v_hat = v / (1.0 - beta2 ** (epoch + 1))
    lr_tau = DEFAULT_LR_TAU if cfg.lr_tau is None else cfg.lr_tau
    tau_new = (tau - lr_tau * m_hat / (v_hat + rule.tau_eps)).clamp(rule.tau_min, rule.tau_max)
    d_anchor = d_anchor.to(acc) - (w * scale * r)[:, None] * (bt.y if rows else bt.x)  # through s_ii
    new = {"log_u": log_u, "tau": tau_new, "bound": bound, "m": m, "v": v}
    return new, log_g, d_anchor, w * scale * r


def step(
    tables: SampleTables,
    cfg: LossConfig,
    gamma: float,
    epoch: int,
    bt: GlobalBatch,
    index: Tensor,
    old_rows: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """v2 for this rank: (value, d/dx [b,d], d/dy [b,d], mean updated τ over the global batch (0-d, for
    logging)); the tables are updated for the global batch. ``old_rows`` [b, C]: this rank's table rows
    before the step. Called by every rank (one all_gather)."""
    acc, dev = bt.x.dtype, bt.x.device
    names = tables.names
    old_rows = old_rows.to(device=dev, dtype=acc)
    new, log_g, d_anchor, dsii_own = {}, {}, {}, {}
    for side, rows in (("image", True), ("text", False)):
        old = {k: old_rows[:, names.index(f"{k}_{side}")] for k in PER_SIDE}
        new[side], log_g[side], d_anchor[side], dsii_own[side] = _side_update(
            cfg, gamma, epoch, bt, old, rows
        )
    ids = index.detach().to(device=dev, dtype=torch.float64)
    cols = [new[s][k] for k in PER_SIDE for s in SIDES] + [log_g["image"], log_g["text"]]
    packed = gather_rows(torch.stack([ids] + [c.double() for c in cols], 1), bt, tables.group)
    idx_all = packed[:, 0].long()
    check_unique(idx_all)
    order = [f"{k}_{s}" for k in PER_SIDE for s in SIDES]
    tables.write_gathered(idx_all, packed[:, 1 : 1 + len(order)][:, [order.index(n) for n in names]], bt.b)
    g = {n: packed[:, 1 + i].to(acc) for i, n in enumerate(order)}
    log_g_all = {"image": packed[:, -2].to(acc), "text": packed[:, -1].to(acc)}
    den = {s: log_plus_eps(g[f"log_u_{s}"], cfg.eps) for s in SIDES}
    value = sum((log_g_all[s] - den[s]).exp().mean() for s in SIDES)
    # negative side with the post-update τ and bounds of every anchor in the global batch
    w = torch.full((bt.size,), 1.0 / (2 * bt.size), dtype=acc, device=dev)
    one = torch.ones((), dtype=acc, device=dev)
    norm = {s: bt.sii_all / g[f"tau_{s}"] + g[f"bound_{s}"] + bt.log_bm1 + den[s] for s in SIDES}
    _, dx_neg, _, _ = lse_backward(
        bt.yg,
        bt.x,
        1.0 / g["tau_text"],
        one,
        norm["text"],
        None,
        w,
        None,
        -bt.off,
        backend=cfg.backend,
        compute_dx=False,
    )
    _, dy_neg, _, _ = lse_backward(
        bt.xg,
        bt.y,
        1.0 / g["tau_image"],
        one,
        norm["image"],
        None,
        w,
        None,
        -bt.off,
        backend=cfg.backend,
        compute_dx=False,
    )
    dx = d_anchor["image"] + dx_neg.to(acc) - dsii_own["text"][:, None] * bt.y
    dy = d_anchor["text"] + dy_neg.to(acc) - dsii_own["image"][:, None] * bt.x
    k = bt.num_ranks
    tau_mean = 0.5 * (g["tau_image"].mean() + g["tau_text"].mean())
    return value, k * dx, k * dy, tau_mean
