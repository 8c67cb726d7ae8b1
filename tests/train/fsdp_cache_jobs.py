"""Rank side of test_fsdp.py's gradient-cache check (imported by bare name; ``_launch.run_rank_script``).

Every rank takes one ``forward_backward`` of gradcache_jobs' small CLIP on its slice of the fixed global
batch, sharded with ``train/fsdp.shard``, for micro-batches 0 (one pass) and 2 (the cache: 3 micro-batches of
the local 5), counting the reduce-scatters FSDP2 really issues (``torch.distributed.reduce_scatter_single``,
the call of its default reduce-scatter), and returns the whole gradients (``full_tensor``) next to DDP's for
the same step.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from _launch import rank_main


def _sharded_grads(loss_name: str, micro: int, rank: int, world: int) -> tuple[dict, int]:
    import torch.distributed as dist
    from gradcache_jobs import GLOBAL_BATCH, LOSSES, _batch, _model, _seed

    from toolkit.core.config import build
    from toolkit.train import fsdp
    from toolkit.train.losses import LossConfig, build_loss
    from toolkit.train.step import StepInputs, forward_backward

    cfg = build(LossConfig, LOSSES[loss_name])  # gradcache_jobs._setup without its DDP wrapper
    model = _model(False, cfg.init_logit_bias)
    model.clip.logit_scale.requires_grad_(cfg.learns_logit_scale)
    loss = build_loss(cfg, data_size=40)
    b = GLOBAL_BATCH // world
    images, tokens, index = (t[rank * b : (rank + 1) * b] for t in _batch())
    sharded = fsdp.shard(model, "fp32", False, torch.device("cpu"))
    calls, real = [0], dist.reduce_scatter_single

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    dist.reduce_scatter_single = counted
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
        dist.reduce_scatter_single = real
    sharded.finish_backward()
    grads = {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for n, p in model.clip.named_parameters()
        if p.grad is not None
    }
    return grads, calls[0]


def _job(world: int, k: int, rank: int) -> dict:
    from gradcache_jobs import grads

    out = {}
    for micro in (0, 2):
        sharded, calls = _sharded_grads("fastclip-v3", micro, rank, world)
        out[micro] = {
            "sharded": sharded,
            "calls": calls,
            "ddp": grads("fastclip-v3", micro, rank, world, False),
        }
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    rank_main(_job, sys.argv[1])
