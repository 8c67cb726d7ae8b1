"""Multi-process gloo jobs for the distributed tests: one spawned job per world size runs every check.

``spawn_job(world, out_dir)`` starts ``world`` CPU processes on a free 127.0.0.1 port; each rank runs
``_job`` and saves its results to ``out_dir/rank{r}.pt``; the tests compare them with K=1 references
computed in the pytest process by the same helpers (``TwoTower``, ``global_batch``, ``global_features``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
import torch.multiprocessing as mp
from _launch import free_port, rank_env
from torch import nn
from torch.nn.functional import normalize

from toolkit.core import dist as D
from toolkit.train.ddp import grad_sync, wrap_ddp
from toolkit.train.losses.modes import MODES, contrastive_loss, mean_over_ranks

LOCAL_BATCH = 3  # odd on purpose
FEATURE_BATCHES = (1, 5)  # local batch sizes of the feature-level checks (batch 1 included)
FEATURE_DIM = 7
SEEDS = {"init": 0, "batch": 1, "micro1": 2, "micro2": 3, "features": 4}


class TwoTower(nn.Module):
    """A small CLIP-shaped model: MLP image tower, linear text tower, learnable logit scale."""

    def __init__(self, d_img: int = 12, d_txt: int = 10, d: int = 8):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(d_img, 16), nn.Tanh(), nn.Linear(16, d))
        self.text = nn.Linear(d_txt, d)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, img: torch.Tensor, txt: torch.Tensor):
        return normalize(self.image(img), dim=-1), normalize(self.text(txt), dim=-1), self.logit_scale.exp()


def make_model() -> TwoTower:
    torch.manual_seed(SEEDS["init"])
    return TwoTower()


def global_batch(seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, 12, generator=g), torch.randn(size, 10, generator=g)


def global_features(b: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random unit features [world·b, FEATURE_DIM] ×2 and a scale, fixed by (b, world)."""
    g = torch.Generator().manual_seed(SEEDS["features"] * 1000 + b * 10 + world)
    x = normalize(torch.randn(world * b, FEATURE_DIM, generator=g), dim=1)
    y = normalize(torch.randn(world * b, FEATURE_DIM, generator=g), dim=1)
    return x, y, torch.tensor(2.0 + torch.rand((), generator=g).item() * 10)


def _local(t: torch.Tensor, rank: int, b: int) -> torch.Tensor:
    return t[rank * b : (rank + 1) * b]


def _model_step(mode: str, rank: int, world: int, grad_dtype: str = "fp32") -> dict:
    """One DDP step on this rank's slice of the global batch: loss (mean over ranks), grads, ledger."""
    model = wrap_ddp(make_model(), grad_dtype=grad_dtype, bucket_cap_mb=0.0005)  # several buckets
    img, txt = global_batch(SEEDS["batch"], world * LOCAL_BATCH)
    D.LEDGER.reset()
    i, t, s = model(_local(img, rank, LOCAL_BATCH), _local(txt, rank, LOCAL_BATCH))
    loss = contrastive_loss(i, t, s, mode=mode)
    loss.backward()
    ledger = D.LEDGER.step()
    return {
        "loss": mean_over_ranks(loss).item(),
        "ledger": ledger,
        "grads": {n: p.grad.clone() for n, p in model.module.named_parameters()},
    }


def _feature_step(mode: str, rank: int, world: int, b: int, group=None) -> dict:
    """loss_r and the gradients of this rank's leaf features and its logit_scale copy."""
    x, y, a = global_features(b, world)
    xl, yl = _local(x, rank, b).clone().requires_grad_(), _local(y, rank, b).clone().requires_grad_()
    a = a.clone().requires_grad_()
    loss = contrastive_loss(xl, yl, a, mode=mode, group=group)
    dx, dy, da = torch.autograd.grad(loss, (xl, yl, a))
    return {"loss": loss.item(), "dx": dx, "dy": dy, "da": da.item()}


def _no_sync_steps(rank: int, world: int) -> dict:
    """Two accumulation micro-steps: the first without gradient sync, the second synced."""
    model = wrap_ddp(make_model())
    out = {}
    D.LEDGER.reset()
    for name, sync in (("micro1", False), ("micro2", True)):
        img, txt = global_batch(SEEDS[name], world * LOCAL_BATCH)
        with grad_sync(model, enabled=sync):
            i, t, s = model(_local(img, rank, LOCAL_BATCH), _local(txt, rank, LOCAL_BATCH))
            contrastive_loss(i, t, s, mode="fastclip").backward()
        out[f"{name}_ledger"] = D.LEDGER.step()
        out[f"{name}_grads"] = {n: p.grad.clone() for n, p in model.module.named_parameters()}
    return out


def _unequal(rank: int, world: int) -> dict:
    """Rank 1 brings one more sample: every mode and all_gather_nograd must refuse on every rank."""
    errors = {}
    b = LOCAL_BATCH + (rank == 1)
    x = normalize(torch.randn(b, FEATURE_DIM), dim=1)
    for mode in MODES:
        try:
            contrastive_loss(x, x, torch.tensor(10.0), mode=mode)
            errors[mode] = None
        except ValueError as e:
            errors[mode] = str(e)
    try:
        D.all_gather_nograd(x)
        errors["all_gather_nograd"] = None
    except ValueError as e:
        errors["all_gather_nograd"] = str(e)
    return errors


def _subgroups(rank: int, world: int) -> dict:
    """Every mode on process groups of size 1 (each rank alone) and, at world 4, of size 2."""
    out = {}
    sizes = (1, 2) if world == 4 else (1,)
    for size in sizes:
        group, _ = torch.distributed.new_subgroups(group_size=size)
        sub_rank = D.get_rank(group)
        for mode in MODES:
            x, y, a = global_features(LOCAL_BATCH, size)
            xl = _local(x, sub_rank, LOCAL_BATCH).clone().requires_grad_()
            yl = _local(y, sub_rank, LOCAL_BATCH).clone().requires_grad_()
            al = a.clone().requires_grad_()
            loss = contrastive_loss(xl, yl, al, mode=mode, group=group)
            dx, dy, da = torch.autograd.grad(loss, (xl, yl, al))
            out[(size, mode)] = {
                "loss": loss.item(),
                "dx": dx,
                "dy": dy,
                "da": da.item(),
                "sub_rank": sub_rank,
            }
    return out


def _job(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    D.init_from_env(backend="gloo", timeout_s=120)
    # An exception ends this rank; mp.spawn then terminates the others and re-raises with the traceback.
    res = {
        "model": {m: _model_step(m, rank, world) for m in MODES},
        "model_bf16": {m: _model_step(m, rank, world, "bf16") for m in ("gather", "fastclip")},
        "features": {(b, m): _feature_step(m, rank, world, b) for b in FEATURE_BATCHES for m in MODES},
        "no_sync": _no_sync_steps(rank, world),
        "unequal": _unequal(rank, world),
        "subgroups": _subgroups(rank, world),
    }
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    D.destroy()


def spawn_job(world: int, out_dir: Path) -> list[dict]:
    """Run ``_job`` on ``world`` gloo processes; returns each rank's results (rank order)."""
    mp.spawn(_job, args=(world, free_port(), str(out_dir)), nprocs=world, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
