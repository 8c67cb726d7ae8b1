"""Multi-process gloo job of the distributed sigmoid-loss tests (tests/train/losses/test_siglip_dist.py).

``spawn_siglip_job(world, out_dir)`` runs ``world`` CPU processes; each rank evaluates, on its slice of
fixed float64 global inputs, cliptk's sigmoid loss in every mode (and through the trainer's objective),
and open_clip's own distributed ``SigLipLoss`` (bidir and gather exchanges) as a second oracle, and saves
the loss share and the gradients of its leaves to ``out_dir/rank{r}.pt``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.multiprocessing as mp
from _launch import free_port, rank_env
from torch.nn.functional import normalize

from toolkit.core import dist as D

LOCAL_BATCHES = (1, 3)  # batch 1 and an odd local batch
FEATURE_DIM = 7


def global_inputs(b: int, world: int) -> tuple[torch.Tensor, ...]:
    """Unit features [world·b, FEATURE_DIM] ×2 (float64), a scale t and a bias, fixed by (b, world); t and
    the bias are drawn near SigLIP's init (10, −10) but off it, so no symmetry hides an error."""
    g = torch.Generator().manual_seed(7000 + 10 * b + world)
    x = normalize(torch.randn(world * b, FEATURE_DIM, generator=g, dtype=torch.float64), dim=1)
    y = normalize(torch.randn(world * b, FEATURE_DIM, generator=g, dtype=torch.float64), dim=1)
    t = 5.0 + 10.0 * torch.rand((), generator=g, dtype=torch.float64)
    return x, y, t, -t + torch.randn((), generator=g, dtype=torch.float64)


def _grads(fn, rank: int, world: int, b: int) -> dict:
    x, y, t, bias = global_inputs(b, world)
    leaves = [
        x[rank * b : (rank + 1) * b].clone(),
        y[rank * b : (rank + 1) * b].clone(),
        t.clone(),
        bias.clone(),
    ]
    leaves = [v.requires_grad_() for v in leaves]
    D.LEDGER.reset()
    loss = fn(*leaves)
    dx, dy, dt, db = torch.autograd.grad(loss, leaves)
    return {
        "loss": loss.item(),
        "dx": dx,
        "dy": dy,
        "dt": dt.item(),
        "db": db.item(),
        "ledger": D.LEDGER.step(),
    }


def _job(rank: int, world: int, port: int, out_dir: str) -> None:
    from open_clip.loss import SigLipLoss

    from toolkit.train.losses import LossConfig, build_loss
    from toolkit.train.losses.siglip.modes import MODES, sigmoid_loss

    os.environ.update(rank_env(rank, world, port))
    torch.set_num_threads(1)
    D.init_from_env(backend="gloo", timeout_s=120)
    res = {}
    for b in LOCAL_BATCHES:
        for mode in MODES:
            res[(b, mode)] = _grads(
                lambda x, y, t, c, m=mode: sigmoid_loss(x, y, t, c, mode=m), rank, world, b
            )
            objective = build_loss(LossConfig(kind="siglip", mode=mode))
            res[(b, f"objective_{mode}")] = _grads(
                lambda x, y, t, c, o=objective: o(x, y, t, torch.arange(x.shape[0]), logit_bias=c),
                rank,
                world,
                b,
            )
        for impl in ("bidir", "gather"):
            oc = SigLipLoss(rank=rank, world_size=world, dist_impl=impl)
            res[(b, f"open_clip_{impl}")] = _grads(oc, rank, world, b)
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")
    D.destroy()


def spawn_siglip_job(world: int, out_dir: Path) -> list[dict]:
    """Run ``_job`` on ``world`` gloo processes; returns each rank's results (rank order)."""
    mp.spawn(_job, args=(world, free_port(), str(out_dir)), nprocs=world, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
