"""Pieces shared by the FastCLIP versions: the gathered global batch and the log-domain estimators.

Log domain: the reference stores u = (1−γ)u + γg with g = 1/(B−1) Σ_{j≠i} exp((s_ij − s_ii)/τ), which
overflows fp32 at τ = 0.01 (s_ij − s_ii up to 2 gives exp(200)). We store log u and compute
log g = LSE_{j≠i}(s_ij/τ) − s_ii/τ − log(B−1) with the kernels' LSE: identical in exact arithmetic,
finite for every τ ≥ 0.01. The surrogate weights exp(a(s_ij − s_ii)) / ((B−1)(u_i+ε)) are the kernels'
P_ij with the normaliser n_i = a·s_ii + log(B−1) + log(u_i+ε), and since u_new ≥ γ·g they never exceed
1/γ: no step of the gradient overflows either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from toolkit.core import dist as cdist
from toolkit.train.losses.modes.anchors import anchor_grads
from toolkit.train.losses.modes.common import accumulation_dtype, gather_pairs

LOG_RESET = math.log(1e-35)  # the reference re-initialises u < 1e-35 (and inf / nan) when γ < 1


@dataclass
class GlobalBatch:
    """One rank's view of the global batch (K ranks × b rows, B = K·b), in the accumulation dtype.

    xg, yg: all rows [B, d] (gathered without autograd when K > 1); x, y: this rank's rows [b, d] (the
    views xg[off:off+b], yg[off:off+b]); sii_all: positive-pair similarities [B], sii its [b] slice;
    off = rank·b (this rank's rows in the global batch, the kernels' ``diag_offset``).
    """

    x: Tensor
    y: Tensor
    xg: Tensor
    yg: Tensor
    sii: Tensor
    sii_all: Tensor
    rank: int
    num_ranks: int
    off: int

    @property
    def b(self) -> int:
        return self.x.shape[0]

    @property
    def size(self) -> int:
        return self.xg.shape[0]

    @property
    def log_bm1(self) -> float:
        return math.log(self.size - 1)


def gather_batch(
    image_features: Tensor, text_features: Tensor, group, check_sizes: bool = True
) -> GlobalBatch:
    """Gather the features of every rank (no autograd): one all_gather of the stacked [b, 2, d] (in the
    promoted feature dtype: bf16/fp16 under AMP). ``check_sizes``: refuse unequal b across ranks first
    (one tiny all_gather; the trainer skips it, its loader guarantees equal batches). Called by all ranks."""
    if image_features.dim() != 2 or image_features.shape != text_features.shape:
        raise ValueError(
            f"image and text features must both be [b, d]; got {tuple(image_features.shape)} "
            f"and {tuple(text_features.shape)}"
        )
    acc = accumulation_dtype(image_features)
    rank, k, b = cdist.get_rank(group), cdist.get_world_size(group), image_features.shape[0]
    if k > 1:
        xg, yg = gather_pairs(image_features, text_features, group, check_sizes=check_sizes)
        xg, yg = xg.to(acc), yg.to(acc)
    else:
        xg, yg = image_features.detach().to(acc), text_features.detach().to(acc)
    if xg.shape[0] < 2:
        raise ValueError(
            "FastCLIP needs a global batch of at least 2 pairs (the estimators average over "
            f"the B−1 negatives); got {xg.shape[0]}"
        )
    sii_all = (xg * yg).sum(1)
    # this rank's rows are a slice of the gathered batch (the same values: gathered exactly, then upcast)
    mine = slice(rank * b, (rank + 1) * b)
    return GlobalBatch(xg[mine], yg[mine], xg, yg, sii_all[mine], sii_all, rank, k, rank * b)


def gather_rows(rows: Tensor, batch: GlobalBatch, group) -> Tensor:
    """Per-sample scalars [b, C] (float64, so sample ids travel exactly) -> [B, C]. Called by all ranks."""
    if batch.num_ranks == 1:
        return rows
    return cdist.all_gather_nograd(rows.to(torch.float64), group, cdist.SCALARS, check_sizes=False)


def check_unique(index_all: Tensor) -> None:
    """Sample ids must be distinct within a global batch (the table updates assume it)."""
    uniq, counts = torch.unique(index_all, return_counts=True)
    if bool((counts > 1).any()):
        dup = uniq[counts > 1][:5].tolist()
        raise ValueError(
            f"sample ids repeat within the global batch (e.g. {dup}); FastCLIP needs each "
            "sample at most once per step (dense global ids, no duplicates across ranks)"
        )


def ema_log(log_u_old: Tensor, log_g: Tensor, gamma: float, shift: Tensor | None = None) -> Tensor:
    """log((1−γ)·u_old·e^shift + γ·g), with the reference's first-visit rule: when γ < 1, an old value
    u < 1e-35, inf or nan is replaced by g. γ ≥ 1 gives g exactly (the reference's 0·u + g)."""
    if gamma >= 1.0:
        return log_g.clone()
    carried = log_u_old + math.log1p(-gamma)
    if shift is not None:
        carried = carried + shift
    new = torch.logaddexp(carried, log_g + math.log(gamma))
    bad = (log_u_old < LOG_RESET) | torch.isnan(log_u_old) | (log_u_old == math.inf)
    return torch.where(bad, log_g, new)


def scent_log(
    log_u_old: Tensor, log_g: Tensor, offset: float, eps: float, shift: Tensor | None = None
) -> Tensor:
    """SCENT's update (``u_update: scent``; Optimization-AI/SCENT, contrastive/scent.patch,
    SogCLRLoss.forward): the moving average with a per-sample step γ_i = σ(log(u_old,i + ε) + γ_s) instead of
    one γ: log((1−γ_i)·u_old·e^shift + γ_i·g), and the same first-visit rule as ``ema_log`` (old u < 1e-35,
    inf or nan → g). The patch stores log(ε + g) where we store log g, so its σ(u_i + γ) is σ(log(u_i + ε) +
    γ_s) here; with ``shift`` (u_drift: batch) the step is taken from the shifted old value. [b] -> [b]."""
    carried = log_u_old if shift is None else log_u_old + shift
    z = log_plus_eps(carried, eps) + offset
    # log γ_i and log(1 − γ_i) as log-sigmoids: exact where σ rounds to 0 or 1
    new = torch.logaddexp(
        carried + torch.nn.functional.logsigmoid(-z), log_g + torch.nn.functional.logsigmoid(z)
    )
    bad = (log_u_old < LOG_RESET) | torch.isnan(log_u_old) | (log_u_old == math.inf)
    return torch.where(bad, log_g, new)


def log_plus_eps(log_u: Tensor, eps: float) -> Tensor:
    """log(u + ε) from log u."""
    if eps <= 0:
        return log_u
    return torch.logaddexp(log_u, torch.full_like(log_u, math.log(eps)))


def row_max(x: Tensor, y: Tensor, chunk_elems: int = 1 << 24) -> Tensor:
    """max_j <x_i, y_j> for every row of x [M, d] against y [N, d], in row chunks (never M×N at once)."""
    rows = max(1, chunk_elems // max(y.shape[0], 1))
    return torch.cat([(x[i : i + rows] @ y.T).amax(1) for i in range(0, x.shape[0], rows)])


def surrogate_grads(
    batch: GlobalBatch, a: Tensor, n1: Tensor, n2: Tensor, r1: Tensor, r2: Tensor, c: Tensor, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    """This rank's share of ∇ c/2 · (1/B) Σ_i (r1_i + r2_i) with r_i = 1/(B−1) Σ_{j≠i} exp(a·s_ij − a·s_ii −
    d_i) and the per-anchor offsets d held fixed: (dx [b, d], dy [b, d], d/da of its anchors' terms, c fixed).

    n1, n2 [B]: every anchor's normaliser a·s_ii + log(B−1) + d_i (FastCLIP: d = log(u+ε); NeuCLIP: the
    predicted α); r1, r2 [B] the terms themselves. No communication (the gathered normalisers carry it)."""
    w = c / (2 * batch.size)
    dx, dy, dsum = anchor_grads(batch.x, batch.y, batch.xg, batch.yg, a, n1, n2, w, batch.off, True, backend)
    mine = slice(batch.off, batch.off + batch.b)
    mine_r = r1[mine] + r2[mine]
    # ∂/∂s_ii of the anchors' own terms (s_ii appears in every term of its row and column)
    dsii = -w * a * mine_r
    dx = dx + dsii[:, None] * batch.y
    dy = dy + dsii[:, None] * batch.x
    return dx, dy, dsum - w * (batch.sii * mine_r).sum()


def batch_drift(old: Tensor, log_g1: Tensor, log_g2: Tensor, group=None) -> list[float]:
    """``u_drift: batch``: the global batch's mean log(g/u_old) per side (image, text anchors) over the
    samples seen before (``old`` [b, C]: this rank's table rows before the step, log u in columns 0 and 1; log
    g [b]); 0 for a side with none seen. One all_reduce of 4 float64 sums; called by every rank of
    ``group``."""
    sums = []
    for old_col, log_g in ((old[:, 0], log_g1), (old[:, 1], log_g2)):
        seen = (old_col >= LOG_RESET) & torch.isfinite(old_col)
        sums += [
            torch.where(seen, log_g - old_col, torch.zeros_like(log_g)).sum().double(),
            seen.sum().double(),
        ]
    sums = cdist.all_reduce_sum(torch.stack(sums), group)
    return [float(sums[i] / sums[i + 1]) if sums[i + 1] > 0 else 0.0 for i in (0, 2)]
