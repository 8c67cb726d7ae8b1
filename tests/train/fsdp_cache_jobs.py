"""Rank side of test_fsdp.py's gradient-cache check (imported by bare name; ``_launch.run_rank_script``).

Every rank takes one ``forward_backward`` of gradcache_jobs' small CLIP on its slice of the fixed global
batch, sharded with ``train/fsdp.shard``, for micro-batches 0 (one pass) and 2 (the cache: 3 micro-batches of
the local 5), counting the reduce-scatters and all-gathers FSDP2 really issues
(``torch.distributed.reduce_scatter_single`` and ``all_gather_single``, the calls of its defaults) beside
what the ledger recorded and ``toolkit plan --fsdp`` predicts, and returns the whole gradients
(``full_tensor``) next to DDP's for the same step.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from _launch import rank_main


def _sharded_grads(loss_name: str, micro: int, rank: int, world: int) -> tuple[dict, int]:
    import torch.distributed as dist
    from gradcache_jobs import GLOBAL_BATCH, LOSSES, _batch, _model, _seed

    from toolkit.core import dist as D
    from toolkit.core.config import build
    from toolkit.train import fsdp
    from toolkit.train.losses import LossConfig, build_loss
    from toolkit.train.plan.fsdp_memory import traffic as fsdp_traffic
    from toolkit.train.plan.fsdp_memory import units_of
    from toolkit.train.step import StepInputs, forward_backward

    cfg = build(LossConfig, LOSSES[loss_name])  # gradcache_jobs._setup without its DDP wrapper
    model = _model(False, cfg.init_logit_bias)
    model.clip.logit_scale.requires_grad_(cfg.learns_logit_scale)
    loss = build_loss(cfg, data_size=40)
    b = GLOBAL_BATCH // world
    images, tokens, index = (t[rank * b : (rank + 1) * b] for t in _batch())
    planned = fsdp_traffic(
        num_params=sum(p.numel() for p in model.clip.parameters()),
        num_trainable=sum(p.numel() for p in model.clip.parameters() if p.requires_grad),
        units=units_of(model.clip),
        world=world,
        param_bytes=4,
        num_micro=-(-b // micro) if micro else 0,
    )["params"]
    sharded = fsdp.shard(model, "fp32", False, torch.device("cpu"))
    calls, real, real_gather = [0], dist.reduce_scatter_single, dist.all_gather_single
    gathers = [0, 0]  # all-gathers FSDP2 issued, bytes of this rank's inputs to them

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    def counted_gather(output, shard, *args, **kwargs):
        gathers[0] += 1
        gathers[1] += shard.numel() * shard.element_size()
        return real_gather(output, shard, *args, **kwargs)

    dist.reduce_scatter_single, dist.all_gather_single = counted, counted_gather
    D.LEDGER.reset()
    try:
        forward_backward(
            model,
            loss,
            StepInputs(images, tokens, index),
            micro_batch_size=micro,
            seed_of=_seed(rank),
            autocast=contextlib.nullcontext,
        )
    finally:
        dist.reduce_scatter_single, dist.all_gather_single = real, real_gather
    sharded.finish_backward()
    ledger = D.LEDGER.current()
    recorded = [ledger[f"comm/all_gather/{fsdp.PARAMS}/{k}"] for k in ("calls", "bytes", "sent_bytes")]
    grads = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in model.clip.named_parameters()
        if p.grad is not None
    }
    return grads, calls[0], (gathers, recorded, planned)


def _job(world: int, k: int, rank: int) -> dict:
    from gradcache_jobs import grads

    out = {}
    for micro in (0, 2):
        sharded, calls, gathers = _sharded_grads("fastclip-v3", micro, rank, world)
        out[micro] = {
            "sharded": sharded,
            "calls": calls,
            "gathers": gathers,
            "ddp": grads("fastclip-v3", micro, rank, world, False),
        }
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    rank_main(_job, sys.argv[1])
