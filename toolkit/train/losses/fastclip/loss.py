"""``FastCLIPLoss``: FastCLIP v0–v3 with the semantics of the reference (Optimization-AI/fast_clip).

Per global batch (B pairs, L2-normalised image rows x, text rows y, s_ij = <x_i, y_j>, a = exp(p) = 1/τ):
    g1_i = 1/(B−1) Σ_{j≠i} exp(a(s_ij − s_ii)),   g2_i = 1/(B−1) Σ_{j≠i} exp(a(s_ji − s_ii))
    u[idx_i] ← (1−γ)·u[idx_i] + γ·g_i          (γ < 1: old u < 1e-35, inf or nan → g_i)
    model gradient = c/2 · ∇ (1/B) Σ_i [g1_i/(u1_i+ε) + g2_i/(u2_i+ε)],  u fixed,  c = τ (v3) else 1.
Versions: v0 learnable τ through the surrogate; v1 constant τ (no gradient to the logit scale); v3
(RGCL-g) value τ·S + ρτ + τ/2·mean(log u1 + log u2), gradient to τ as the reference forms it; v2
individual temperatures (``toolkit.train.losses.fastclip.individual``).

**The τ-gradient is doubled, on purpose.** The reference splits each rank's loss into loss1 (its
anchors against all negatives) and loss2 (all anchors against its negatives); the feature gradients of
the two halves are disjoint, but both halves depend on the logit scale, so after DDP averaging the
surrogate's a-gradient is (1/B) Σ_i ∂(g1_i/(u1_i+ε) + g2_i/(u2_i+ε))/∂a — twice the gradient of the
objective whose feature gradient it is. The published ρ and lr_tau (v3) and lr for p (v0) were tuned
with that gradient, so it is reproduced here (v0 and v3).

Gradient convention: without a process group, after ``loss.backward()`` the gradients on the features
and on p equal the reference's DDP-averaged gradients for the batch. Under torch.distributed each rank
gets K × its share of the global gradient (features: its own rows; p: its anchors' terms), so that
DDP's mean over ranks gives exactly the single-process gradient of the global batch. The returned value
is the reference's rank-averaged loss, identical on every rank. Communication per step (``fastclip``
mode): one all_gather of the features [b, 2, d] and one of per-sample scalars [b, C] (ids, log u, log g;
v2 adds τ, bound, m, v), no autograd, no feature-gradient exchange; each rank does O(b·B) work.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from toolkit.core import dist as cdist
from toolkit.train.losses.base import StatePart, TrainingLoss
from toolkit.train.losses.config import LossConfig
from toolkit.train.losses.fastclip import individual
from toolkit.train.losses.fastclip.attach import attach
from toolkit.train.losses.fastclip.estimators import (
    GlobalBatch,
    batch_drift,
    check_unique,
    ema_log,
    gather_batch,
    gather_rows,
    log_plus_eps,
    scent_log,
    surrogate_grads,
)
from toolkit.train.losses.fastclip.schedules import final_gamma, gamma_at_epoch, gamma_at_step
from toolkit.train.losses.fastclip.tables import SampleTables
from toolkit.train.losses.modes.anchors import anchor_lses

VERSIONS = ("v0", "v1", "v2", "v3")


class FastCLIPLoss(TrainingLoss):
    """FastCLIP loss with its per-sample state (see the module docstring for the maths).

    ``cfg``: a ``LossConfig`` with kind fastclip (its ``fastclip`` section: version, γ schedule, v2's τ rule;
    shared: ρ, ε, τ settings, backend).
    ``data_size`` N: sample ids are 0..N−1. ``group``: process group (default world). ``table_dtype``:
    dtype of the tables (fp32 as the reference; fp64 for oracles); ``share_tables``: one table per node
    in shared memory (see ``tables``). Tables (``self.tables``, columns): log_u_image, log_u_text (all
    versions), and for v2 tau_image, tau_text, bound_image, bound_text, m_image, m_text, v_image,
    v_text. ``table("u_image")`` etc. give u.
    """

    needs_data_size = True
    value_is_global = True  # every rank computes the global value from the gathered batch

    def __init__(
        self,
        cfg: LossConfig,
        data_size: int,
        group=None,
        *,
        table_dtype: torch.dtype = torch.float32,
        share_tables: bool = True,
        check_sizes: bool = True,
    ):
        super().__init__(cfg, group, check_sizes=check_sizes)
        if cfg.kind != "fastclip":
            raise ValueError(f"FastCLIPLoss needs a LossConfig of kind fastclip, got {cfg.kind!r}")
        # build() checks the Literal; a LossConfig made in code may not be
        if cfg.fastclip.version not in VERSIONS:
            raise ValueError(f"unknown FastCLIP version {cfg.fastclip.version!r}; choose one of {VERSIONS}")
        self.version, self.data_size = cfg.fastclip.version, data_size
        self.epoch, self.gamma, self.u_shift = 0, 1.0, [0.0, 0.0]  # u_shift: u_drift's last mean log(g/u_old)
        self.gamma_final = final_gamma(cfg.fastclip)  # γ_min, the DRRho rule's γ, or SCENT's offset γ_s
        self._tau_mean: Tensor | None = None
        self._undo: tuple[Tensor, Tensor, torch.device] | None = None  # ids [b], their old rows, device
        columns = {"log_u_image": -math.inf, "log_u_text": -math.inf}
        if self.version == "v2":
            columns.update(individual.table_columns(cfg.tau_init))
        self.tables = SampleTables(data_size, columns, table_dtype, group, share_tables)

    def begin_step(self, step: int, steps_per_epoch: int) -> None:
        """γ for step ``step`` (only ``cosine_step`` changes within an epoch) and the epoch's settings."""
        self.set_epoch(step // steps_per_epoch)
        decay_epochs, schedule = self.cfg.fastclip.gamma_decay_epochs, self.cfg.fastclip.gamma_schedule
        self.gamma = gamma_at_step(step, steps_per_epoch, self.gamma_final, decay_epochs, schedule)

    def end_step(self, applied: bool) -> None:
        """An applied step keeps its table updates; a skipped one restores the rows the last forward
        overwrote, on every node (one all_gather of [b, 1 + C] old rows, only then). Collective."""
        undo, self._undo = self._undo, None
        if applied or undo is None:
            return
        index, rows, device = undo
        packed = torch.cat([index[:, None].double(), rows.double()], 1).to(device)  # nccl gathers on the GPU
        packed = cdist.all_gather_nograd(packed, self.group, cdist.SCALARS, check_sizes=False)
        self.tables.write_gathered(packed[:, 0].long(), packed[:, 1:], index.shape[0])

    def metrics(self) -> dict[str, float]:
        """γ (u_update scent: the offset γ_s); with ``u_drift: batch`` also the last shifts of log u (image,
        text anchors)."""
        drift = self.cfg.fastclip.u_drift == "batch"
        return {
            "gamma": self.gamma,
            **({"u_shift_image": self.u_shift[0], "u_shift_text": self.u_shift[1]} if drift else {}),
        }

    def sync_state(self) -> None:
        """Returns once every rank's table writes are done (before reading the tables outside forward:
        a checkpoint's state_dict, inspection); forward itself is ordered by its collectives."""
        cdist.barrier(self.group)

    def set_epoch(self, epoch: int) -> None:
        """Start of epoch ``epoch`` (0-based): γ for the epoch; v2's Adam betas (0 in epoch 0)."""
        self.epoch = epoch
        fc = self.cfg.fastclip
        self.gamma = gamma_at_epoch(epoch, self.gamma_final, fc.gamma_decay_epochs, fc.gamma_schedule)

    def table(self, name: str) -> Tensor:
        """Column ``name`` of the per-sample tables [N] (a view); ``u_image``/``u_text`` give exp(log u)."""
        if name in ("u_image", "u_text"):
            return self.tables.data[:, self.tables.col("log_" + name)].exp()
        return self.tables.data[:, self.tables.col(name)]

    def state_parts(self) -> list[StatePart]:
        names = tuple(self.tables.names)
        return [StatePart("tables", self.tables, required=names, owned=names)]

    # ----------------------------------------------------------------- forward
    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | None,
        index: Tensor,
        logit_bias: Tensor | None = None,
    ) -> Tensor:
        """Loss for this rank's batch; updates the tables for the global batch.

        image_features, text_features: [b, d] L2-normalised (any float dtype; computed in fp32, fp64
        stays fp64); logit_scale: a = exp(p), 0-d or [1] (ignored by v2, which keeps per-sample τ);
        index: [b] dense global sample ids; logit_bias: unused (no bias in FastCLIP's objectives).
        Called by every rank with the same b. Returns the global
        value (0-d, equal on every rank, so it is also this rank's share) carrying this rank's gradients.
        """
        check_inputs(self.version, image_features, logit_scale, index)
        self.tables.check_index(index)
        batch = gather_batch(image_features, text_features, self.group, self.check_sizes)
        if self.tables.shared and batch.xg.is_cuda:
            # NCCL collectives do not block the host: wait until the feature gather completed, which
            # proves every local peer has finished writing the previous step's rows we may read now.
            torch.cuda.current_stream(batch.xg.device).synchronize()
        # read once, after the gather (local peers' writes of the previous step are done): the undo
        # snapshot and the estimators' old values
        old_rows = self.tables.read(index)
        self._undo = (index.detach().cpu(), old_rows, image_features.device)
        if self.version == "v2":
            value, dx, dy, self._tau_mean = individual.step(
                self.tables, self.cfg, self.gamma, self.epoch, batch, index, old_rows
            )
            pairs = [(image_features, dx), (text_features, dy)]
        else:
            value, dx, dy, da = self._global_step(batch, index, old_rows, logit_scale)
            pairs = [(image_features, dx), (text_features, dy), (logit_scale, da)]
        self._last = value.detach()
        return attach(value, pairs)

    def temperature(self, logit_scale: Tensor) -> float:
        """1/a; v2: the mean per-sample τ over the last global batch (both sides, after its update)."""
        if self.version != "v2":
            return super().temperature(logit_scale)
        return float("nan") if self._tau_mean is None else float(self._tau_mean)

    def _update_u(
        self, batch: GlobalBatch, index: Tensor, old_rows: Tensor, log_g1: Tensor, log_g2: Tensor
    ) -> Tensor:
        """New log u for this rank's rows (``old_rows`` [b, C]: their table rows before this step),
        gathered with ids and log g -> [B, 5]; tables written."""
        old = old_rows.to(device=log_g1.device, dtype=log_g1.dtype)
        log_u1, log_u2, shift = new_log_u(self.cfg, self.gamma, old, log_g1, log_g2, self.group)
        if shift is not None:
            self.u_shift = shift
        ids = index.detach().to(device=log_g1.device, dtype=torch.float64)
        rows = torch.stack([ids, log_u1.double(), log_u2.double(), log_g1.double(), log_g2.double()], 1)
        rows = gather_rows(rows, batch, self.group)
        idx_all = rows[:, 0].long()
        check_unique(idx_all)
        self.tables.write_gathered(idx_all, rows[:, 1:3], batch.b)
        return rows[:, 1:].to(log_g1.dtype)

    def _global_step(self, batch: GlobalBatch, index: Tensor, old_rows: Tensor, logit_scale: Tensor):
        """v0, v1, v3: (value, d/dx, d/dy, d/da) for this rank, in the accumulation dtype."""
        bt, acc = batch, batch.x.dtype
        a = logit_scale.detach().to(acc).reshape(())
        row_lse, col_lse = anchor_lses(bt.x, bt.y, bt.xg, bt.yg, a, bt.off, True, self.cfg.backend)
        log_g1 = row_lse.to(acc) - a * bt.sii - bt.log_bm1
        log_g2 = col_lse.to(acc) - a * bt.sii - bt.log_bm1
        log_u1, log_u2, log_g1_all, log_g2_all = self._update_u(bt, index, old_rows, log_g1, log_g2).unbind(1)
        den1, den2 = log_plus_eps(log_u1, self.cfg.eps), log_plus_eps(log_u2, self.cfg.eps)
        r1_all, r2_all = (log_g1_all - den1).exp(), (log_g2_all - den2).exp()
        surrogate = (r1_all + r2_all).mean()
        c = 1.0 / a if self.version == "v3" else torch.ones((), dtype=acc, device=a.device)
        n1 = a * bt.sii_all + bt.log_bm1 + den1
        n2 = a * bt.sii_all + bt.log_bm1 + den2
        dx, dy, da = surrogate_grads(bt, a, n1, n2, r1_all, r2_all, c, self.cfg.backend)
        mine = slice(bt.off, bt.off + bt.b)
        da = 2.0 * da  # the a-gradient of this rank's anchors, doubled as in the reference (module docstring)
        value = surrogate
        if self.version == "v3":
            tau = 1.0 / a
            mean_log_u = (log_u1 + log_u2).mean()
            value = tau * surrogate + self.cfg.rho * tau + tau / 2 * mean_log_u
            da = (
                da
                - (self.cfg.rho / bt.num_ranks + (log_u1[mine] + log_u2[mine]).sum() / (2 * bt.size)) / a**2
            )
        k = bt.num_ranks
        return value, k * dx, k * dy, (None if self.version == "v1" else k * da)


def new_log_u(
    cfg: LossConfig, gamma: float, old: Tensor, log_g1: Tensor, log_g2: Tensor, group
) -> tuple[Tensor, Tensor, list[float] | None]:
    """This rank's new log u per side [b] from its rows' old values ``old`` [b, >=2] and log g [b]: the moving
    average (or SCENT's step), shifted by ``u_drift: batch``'s drift when it applies (then also returned, the
    shifts of the image and text anchors; else None). Collective when the drift applies (batch_drift)."""
    scent = cfg.fastclip.u_update == "scent"  # its per-sample steps are < 1 whatever γ_s is
    drift = cfg.fastclip.u_drift == "batch" and (scent or gamma < 1)
    shift, shift1, shift2 = None, None, None
    if drift:
        shift = batch_drift(old, log_g1, log_g2, group)
        shift1, shift2 = (torch.tensor(v, dtype=log_g1.dtype, device=log_g1.device) for v in shift)
    if scent:
        return (
            scent_log(old[:, 0], log_g1, gamma, cfg.eps, shift1),
            scent_log(old[:, 1], log_g2, gamma, cfg.eps, shift2),
            shift,
        )
    return ema_log(old[:, 0], log_g1, gamma, shift1), ema_log(old[:, 1], log_g2, gamma, shift2), shift


def check_inputs(version: str, image_features: Tensor, logit_scale: Tensor | None, index: Tensor) -> None:
    """ValueError unless ``logit_scale`` is given (v0, v1, v3) and ``index`` is [b] for
    ``image_features`` [b, d]."""
    if version != "v2" and logit_scale is None:
        raise ValueError(f"FastCLIP {version} needs logit_scale (exp of the model's logit_scale)")
    if index.shape != (image_features.shape[0],):
        raise ValueError(
            f"index must be [b] = [{image_features.shape[0]}] sample ids, got {tuple(index.shape)}"
        )
