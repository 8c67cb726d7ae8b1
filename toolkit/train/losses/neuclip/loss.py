"""``NeuCLIPLoss``: the robust global contrastive loss with learned log-normalisers (arXiv 2511.08417).

Per global batch (B pairs, L2-normalised image rows x, text rows y, s_ij = <x_i, y_j>, a = exp(p) = 1/τ):

    g1_i = 1/(B−1) Σ_{j≠i} exp(a(s_ij − s_ii)),   g2_i = the same over column i  (FastCLIP's g)
    log(ε + g) = min_α [e^{−α}(ε + g) + α − 1]          (convex conjugate of log, minimiser α = log(ε + g))
    value = τ · 1/(2B) Σ_i [e^{−α1_i}(ε + g1_i) + α1_i − 1 + e^{−α2_i}(ε + g2_i) + α2_i − 1] + ρτ

where α1_i, α2_i are the normaliser network's predictions (``network``). The model step treats them as
constants (stop-gradient), so the model gradient is τ/(2B) Σ_i e^{−α_i} ∇g_i — FastCLIP-v3's with
1/(u_i+ε) replaced by e^{−α_i} — and, because the value is linear in g, a mini-batch estimate of g gives an
unbiased gradient of it for α independent of the batch. τ's gradient is the exact derivative of the value
(α fixed; not doubled as FastCLIP's reference does). At α = log(ε + g) the value is τ/2 · mean(log(ε + g1)
+ log(ε + g2)) + ρτ, FastCLIP-v3's objective.

Alternating updates (``neuclip.fit_order``): the network is restarted when due (or grows its prototypes),
then takes ``inner_steps`` AdaGrad steps on its own objective over the step's global batch (features and
g of the forward), either ``before`` the model step uses its predictions (the paper's order: inside
``forward``) or ``after`` it (in ``end_step``: each batch is predicted out of sample). A skipped step
(``end_step(False)``) restores the network as it was before the step.

Distributed (the fastclip mode, no feature-gradient communication): one all_gather of the features
[b, 2, d], one of the per-sample scalars [b, 4] (log g1, log g2, α1, α2), and per network update one
all_reduce of its gradient [2, m, d]. No per-sample state: the sample ids are not used.
"""

from __future__ import annotations

import torch
from torch import Tensor

from toolkit.train.losses.base import StatePart, TrainingLoss
from toolkit.train.losses.config import LossConfig
from toolkit.train.losses.fastclip.attach import attach
from toolkit.train.losses.fastclip.estimators import GlobalBatch, gather_batch, gather_rows, surrogate_grads
from toolkit.train.losses.modes.anchors import anchor_lses
from toolkit.train.losses.neuclip.network import NormaliserNetwork, log_eps_plus


class NeuCLIPLoss(TrainingLoss):
    """NeuCLIP (module docstring); ``cfg.neuclip`` configures the normaliser network.

    State (``state_dict``, flat and world-size independent): ``network.initialised`` [1], and once the first
    forward has initialised it ``network.filled`` [1] (prototypes in use), ``network.weight`` (the prototypes
    [2, m, d]: image side, text side) and ``network.sumsq`` (AdaGrad's sums, same shape)."""

    value_is_global = True  # every rank computes the global value from the gathered batch

    def __init__(self, cfg: LossConfig, group=None, *, check_sizes: bool = True):
        super().__init__(cfg, group, check_sizes=check_sizes)
        if cfg.kind != "neuclip":
            raise ValueError(f"NeuCLIPLoss needs a LossConfig of kind neuclip, got {cfg.kind!r}")
        nc = cfg.neuclip
        self.network = NormaliserNetwork(
            nc.num_prototypes, nc.lr, nc.adagrad_eps, cfg.eps, cfg.backend, group
        )
        self.step = 0
        self._error = float("nan")
        self._fit: tuple | None = None  # what end_step trains the network on (fit_order after)
        self._undo: tuple | None = (
            None  # the network before this step changed it (a skipped step restores it)
        )

    # ----------------------------------------------------------------- TrainingLoss hooks
    def begin_step(self, step: int, steps_per_epoch: int) -> None:
        self.step = step

    def end_step(self, applied: bool) -> None:
        """Applied: with ``fit_order: after``, the network's restart or growth and its ``inner_steps``
        updates on this step's batch. Skipped: the network as it was before the step. Collective."""
        fit, self._fit = self._fit, None
        undo, self._undo = self._undo, None
        if not applied:
            if undo is not None:
                self.network.restore(undo)
            return
        if fit is not None and self.cfg.neuclip.fit_order == "after":
            self._advance(*fit)

    def _advance(self, batch: GlobalBatch, a: Tensor, targets: tuple[Tensor, Tensor], fresh: bool) -> None:
        """Restart the network if due (or fill more prototypes from this batch while fewer than m are in use;
        not when ``fresh``: it was just initialised from this very batch), then ``inner_steps`` updates."""
        nc = self.cfg.neuclip
        if nc.restart_every_steps and self.step > 0 and self.step % nc.restart_every_steps == 0:
            self.network.restart(batch.xg, batch.yg, self.step)
        elif not fresh:
            self.network.grow(batch.xg, batch.yg, self.step)
        self.network.update(batch.x, batch.y, batch.sii, a, targets, batch.size, nc.inner_steps)

    def metrics(self) -> dict[str, float]:
        """``normaliser_error``: mean |α − log(ε + g)| over the last global batch (the α the model step
        used)."""
        return {"normaliser_error": float(self._error)}

    # ----------------------------------------------------------------- state
    def state_parts(self) -> list[StatePart]:
        return [StatePart("network", self.network, required=("initialised",))]

    # ----------------------------------------------------------------- forward
    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor,
        index: Tensor | None = None,
        logit_bias: Tensor | None = None,
    ) -> Tensor:
        """The global value (0-d, equal on every rank) carrying this rank's gradients (module docstring).

        image_features, text_features: [b, d] L2-normalised (computed in fp32; fp64 stays fp64);
        logit_scale: a = exp(p), 0-d or [1]; index, logit_bias: unused. Called by every rank with the same
        b."""
        if logit_scale is None:
            raise ValueError("NeuCLIP needs logit_scale (exp of the model's logit_scale)")
        batch = gather_batch(image_features, text_features, self.group, self.check_sizes)
        self.network.to(batch.xg.device)
        before = self.cfg.neuclip.fit_order == "before"
        fresh = not self.network.initialised
        self._undo = self.network.snapshot() if before or fresh else None
        if fresh:  # the first step: prototypes from this batch
            self.network.restart(batch.xg, batch.yg, self.step)
        a = logit_scale.detach().to(batch.x.dtype).reshape(())
        value, dx, dy, da = self._global_step(batch, a, before, fresh)
        self._last = value.detach()
        pairs = [(image_features, dx), (text_features, dy)]
        if self.cfg.learn_tau:
            pairs.append((logit_scale, da))
        return attach(value, pairs)

    def _global_step(self, bt: GlobalBatch, a: Tensor, before: bool, fresh: bool):
        """(value, d/dx, d/dy, d/da) for this rank, in the accumulation dtype. ``before``: the network is
        fitted on this batch first; else what end_step fits it on is kept."""
        eps, acc = self.cfg.eps, bt.x.dtype
        row_lse, col_lse = anchor_lses(bt.x, bt.y, bt.xg, bt.yg, a, bt.off, True, self.cfg.backend)
        log_g = [lse.to(acc) - a * bt.sii - bt.log_bm1 for lse in (row_lse, col_lse)]
        fit = (bt, a, tuple(log_eps_plus(lg, eps) for lg in log_g), fresh)
        if before:
            self._advance(*fit)
        else:
            self._fit = fit
        alpha = self.network.predict(bt.x, bt.y, bt.sii, a)
        rows = gather_rows(torch.stack([*log_g, *alpha], 1), bt, self.group).to(acc)
        log_g1, log_g2, alpha1, alpha2 = rows.unbind(1)
        t1, t2 = log_eps_plus(log_g1, eps), log_eps_plus(log_g2, eps)
        # kept as a tensor: a float here would sync the device every step; metrics() reads it at logged steps
        self._error = (((alpha1 - t1).abs() + (alpha2 - t2).abs()).mean() / 2).detach()
        # per-anchor conjugate terms e^{t−α} + α − 1 (= log(ε+g) at α = t) and the g-parts r = e^{log g − α}
        terms = (t1 - alpha1).exp() + alpha1 - 1 + (t2 - alpha2).exp() + alpha2 - 1
        tau = 1.0 / a
        value = tau * terms.sum() / (2 * bt.size) + self.cfg.rho * tau
        r1, r2 = (log_g1 - alpha1).exp(), (log_g2 - alpha2).exp()
        n1, n2 = a * bt.sii_all + bt.log_bm1 + alpha1, a * bt.sii_all + bt.log_bm1 + alpha2
        dx, dy, d_surr = surrogate_grads(bt, a, n1, n2, r1, r2, tau, self.cfg.backend)
        # d value/da = τ·dH/da − H/a² with H = terms/(2B) + ρ; this rank: its anchors' terms and ρ/K
        mine = terms[bt.off : bt.off + bt.b].sum() / (2 * bt.size) + self.cfg.rho / bt.num_ranks
        da = d_surr - mine / a**2
        k = bt.num_ranks
        return value, k * dx, k * dy, k * da
