"""NeuCLIP's normaliser network: prototypes that predict each sample's log-normaliser (arXiv 2511.08417).

For an image anchor i (features x_i [d], positive similarity s_ii, scale a = 1/τ) the network predicts

    α1_i = log(ε + 1/m Σ_k exp(a·(cos(x_i, W1_k) − s_ii)))

with m learned prototypes W1 [m, d] standing in for "every text of the dataset" in the optimal value
α1* = log(ε + g1_i) (g1_i: the mean of exp(a(s_ij − s_ii)) over the negatives). Text anchors use W2
(prototypes of images) with y_i. The LSE over prototypes is a row LSE of a·x Ŵᵀ (Ŵ: rows of W scaled to
unit norm), so the tiled kernels compute it and its gradient without a [b, m] matrix.

The network's own objective (per side, over the global batch of B anchors, the encoder held fixed):

    J(W) = 1/B Σ_i [exp(t_i − α_i(W)) + α_i(W)],   t_i = log(ε + g_i),

minimised by α_i = t_i, i.e. the conjugate form of log(ε + g_i) (docs/neuclip.md). It is trained by
AdaGrad (the paper's choice), ``inner_steps`` steps per optimiser step, and restarted every
``restart_every_steps`` steps from the current batch's embeddings (W1 <- texts, W2 <- images), the
paper's two acceleration techniques. A (re)start draws m embeddings from the data; when the global batch
B is smaller than m they come from the next ⌈m/B⌉ batches (``grow``: B new rows per step, each with fresh
AdaGrad sums) and the network uses the rows filled so far: copies of one batch's rows would get equal
gradients and stay equal, leaving only B distinct prototypes.

Distributed: every rank holds the same network. Each rank differentiates J over its own b anchors and
one all_reduce of the stacked gradients [2, m, d] per inner step makes them the global-batch gradient
(identical on every rank, so the AdaGrad updates stay identical). Restarts draw prototypes from the
gathered global batch with a generator seeded by the step: no communication, same result at any world
size.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from toolkit import kernels as K
from toolkit.core import dist as cdist

SIDES = ("image", "text")
RESTART_SEED = 0x6E6575  # seeds the restart draws (offset by the step): identical on every rank


def log_eps_plus(log_v: Tensor, eps: float) -> Tensor:
    """log(ε + v) from log v (ε > 0)."""
    return torch.logaddexp(log_v, torch.full_like(log_v, math.log(eps)))


def draw_rows(num_rows: int, num_samples: int, step: int) -> Tensor:
    """``num_rows`` indices into a batch of ``num_samples``: distinct while they last (whole permutations,
    concatenated when num_rows > num_samples); seeded by ``step`` so every rank draws the same."""
    gen = torch.Generator().manual_seed(RESTART_SEED + step)
    perms = [torch.randperm(num_samples, generator=gen) for _ in range(-(-num_rows // num_samples))]
    return torch.cat(perms)[:num_rows]


class NormaliserNetwork:
    """Prototypes W [2, m, d] (side 0: image anchors, side 1: text anchors) and their AdaGrad sums.

    Uninitialised until ``restart`` (the first forward calls it: d is known only then). ``lr``: AdaGrad's
    learning rate; ``adagrad_eps``: its denominator ε; ``eps``: the objective's ε (LossConfig.eps).
    Called by every rank of ``group`` alike (``update`` is collective)."""

    def __init__(
        self, num_prototypes: int, lr: float, adagrad_eps: float, eps: float, backend: str, group=None
    ):
        self.num_prototypes, self.lr, self.adagrad_eps, self.eps = num_prototypes, lr, adagrad_eps, eps
        self.backend, self.group = backend, group
        self.weight: Tensor | None = None  # [2, m, d]; rows >= filled are not in use yet
        self.sumsq: Tensor | None = None  # [2, m, d] AdaGrad's running sum of squared gradients
        self.filled = 0  # prototypes in use (m once the (re)start has drawn all of them)

    @property
    def initialised(self) -> bool:
        return self.weight is not None

    def restart(self, xg: Tensor, yg: Tensor, step: int) -> None:
        """New prototypes: the first min(m, B) from the global batch xg, yg [B, d] (W1 <- texts, W2 <-
        images), the rest from later batches (``grow``); AdaGrad reset."""
        self.weight = xg.new_zeros(2, self.num_prototypes, xg.shape[1])
        self.sumsq = torch.zeros_like(self.weight)
        self.filled = 0
        self.grow(xg, yg, step)

    def grow(self, xg: Tensor, yg: Tensor, step: int) -> None:
        """Fill the next min(m − filled, B) prototypes from this global batch (no-op once all m are in
        use)."""
        num = min(self.num_prototypes - self.filled, xg.shape[0])
        if num <= 0:
            return
        rows = draw_rows(num, xg.shape[0], step).to(xg.device)
        new = slice(self.filled, self.filled + num)
        self.weight[:, new] = torch.stack([yg.detach()[rows], xg.detach()[rows]]).to(self.weight.dtype)
        self.sumsq[:, new] = 0
        self.filled += num

    def snapshot(self) -> tuple:
        """Everything an update changes (device-side copies), for ``restore`` after a skipped step."""
        if not self.initialised:
            return (None, None, 0)
        return (self.weight.clone(), self.sumsq.clone(), self.filled)

    def restore(self, snap: tuple) -> None:
        self.weight, self.sumsq, self.filled = snap

    def to(self, device: torch.device) -> None:
        if self.weight is not None and self.weight.device != device:
            self.weight, self.sumsq = self.weight.to(device), self.sumsq.to(device)

    def _used(self) -> Tensor:
        return self.weight[:, : self.filled]

    def _unit(self) -> Tensor:
        used = self._used()
        return used / used.norm(dim=2, keepdim=True)

    def _lse(self, side: int, feats: Tensor, a: Tensor, unit: Tensor) -> Tensor:
        row, _ = K.lse_forward(
            feats, unit[side].to(feats.dtype), a, a, None, compute_col=False, backend=self.backend
        )
        return row.to(feats.dtype)

    def predict(self, x: Tensor, y: Tensor, sii: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        """(α1 [b], α2 [b]) for anchors with image rows x [b, d], text rows y [b, d], positives sii [b]."""
        unit, log_m = self._unit(), math.log(self.filled)
        return tuple(
            log_eps_plus(self._lse(s, f, a, unit) - log_m - a * sii, self.eps) for s, f in enumerate((x, y))
        )

    def objective_grad(
        self, x: Tensor, y: Tensor, sii: Tensor, a: Tensor, targets: tuple[Tensor, Tensor], batch_size: int
    ) -> Tensor:
        """∂J/∂W [2, filled, d] of this rank's anchors (J's sum over them, divided by the global
        ``batch_size``).

        targets: (t1, t2) [b] each, t = log(ε + g) of these anchors."""
        unit, log_m = self._unit(), math.log(self.filled)
        grads = []
        for side, (feats, t) in enumerate(zip((x, y), targets, strict=True)):
            lse = self._lse(side, feats, a, unit)
            shifted = lse - log_m - a * sii
            alpha = log_eps_plus(shifted, self.eps)
            # dJ/dα = (1 − e^{t−α})/B; dα/d lse = the share of α's sum not from ε
            g_lse = (1.0 - (t - alpha).exp()) * (shifted - alpha).exp() / batch_size
            _, d_unit, _, _ = K.lse_backward(
                feats,
                unit[side].to(feats.dtype),
                a,
                a,
                lse,
                None,
                g_lse,
                None,
                backend=self.backend,
                compute_dx=False,
            )
            grads.append(d_unit.to(unit.dtype))
        d_unit = torch.stack(grads)
        # through Ŵ = W/|W|: the component along Ŵ does not change Ŵ
        radial = (d_unit * unit).sum(2, keepdim=True)
        return (d_unit - radial * unit) / self._used().norm(dim=2, keepdim=True)

    def update(
        self,
        x: Tensor,
        y: Tensor,
        sii: Tensor,
        a: Tensor,
        targets: tuple[Tensor, Tensor],
        batch_size: int,
        num_steps: int,
    ) -> None:
        """``num_steps`` AdaGrad steps on J over the global batch (this rank's anchors + one all_reduce of
        the [2, filled, d] gradient per step). Collective."""
        for _ in range(num_steps):
            grad = self.objective_grad(x, y, sii, a, targets, batch_size)
            cdist.all_reduce_sum(grad, self.group, cdist.PARAM_GRADS)
            used = slice(0, self.filled)
            self.sumsq[:, used] += grad * grad
            self.weight[:, used] -= self.lr * grad / (self.sumsq[:, used].sqrt() + self.adagrad_eps)

    # ----------------------------------------------------------------- state
    def state(self) -> dict[str, Tensor]:
        """Flat CPU tensors: ``initialised`` [1], and once initialised ``filled`` [1] (prototypes in use),
        ``weight`` and ``sumsq`` [2, m, d]."""
        out = {"initialised": torch.tensor([float(self.initialised)])}
        if self.initialised:
            out.update(
                filled=torch.tensor([float(self.filled)]),
                weight=self.weight.detach().cpu().clone(),
                sumsq=self.sumsq.detach().cpu().clone(),
            )
        return out

    def load(self, state: dict[str, Tensor], source: str = "state_dict") -> None:
        if "initialised" not in state:
            raise KeyError(f"{source}: missing NeuCLIP network entry 'initialised'")
        if not float(state["initialised"].reshape(-1)[0]):
            self.weight = self.sumsq = None
            self.filled = 0
            return
        for name in ("filled", "weight", "sumsq"):
            if name not in state:
                raise KeyError(f"{source}: missing NeuCLIP network entry {name!r}")
            shape = tuple(state[name].shape)
            if name == "filled":
                continue
            if len(shape) != 3 or shape[:2] != (2, self.num_prototypes):
                raise ValueError(
                    f"{source}: NeuCLIP network {name!r} has shape {shape}, expected (2, "
                    f"{self.num_prototypes}, d) (loss.neuclip.num_prototypes)"
                )
        filled = int(state["filled"].reshape(-1)[0])
        if not 1 <= filled <= self.num_prototypes:
            raise ValueError(
                f"{source}: NeuCLIP network 'filled' is {filled}, expected 1..{self.num_prototypes}"
            )
        self.weight, self.sumsq, self.filled = state["weight"].clone(), state["sumsq"].clone(), filled
