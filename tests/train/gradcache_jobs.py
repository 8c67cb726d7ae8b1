"""Gradient-cache checks shared by one-process tests and their 2-process gloo jobs (imported by bare name).

``grads(loss_name, micro, rank, world, dropout)``: the parameter gradients of a small CLIP after one
``forward_backward`` on this rank's slice of a fixed global batch, through DDP when world > 1 (DDP
averages them). ``reference(...)``: the oracle without the cache: the same micro-batch forwards (same
seeds, so the same dropout masks) all kept with their graphs, the loss once over the concatenated
features, one backward: the gradient of the whole global batch. With patch dropout the random state
must be replayed for the two to agree; without dropout the oracle is one plain forward of the batch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

GLOBAL_BATCH = 10
# patch_dropout draws a random patch subset in every forward: exactness needs the replayed random state
CFG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 16, "layers": 1, "width": 32, "head_width": 16, "patch_size": 4},
    "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1},
}
PATCH_DROPOUT = 0.4
LOSSES = {
    "openclip-gather": {"kind": "openclip", "mode": "gather"},
    "fastclip-v1": {"kind": "fastclip", "fastclip": {"version": "v1"}},
    "fastclip-v3": {"kind": "fastclip", "fastclip": {"version": "v3"}},
    "siglip-ring": {"kind": "siglip", "mode": "ring"},  # the model has a learnable logit bias
    "neuclip": {"kind": "neuclip"},
}


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (GLOBAL_BATCH, 16, 16, 3), generator=g, dtype=torch.uint8)
    tokens = torch.randint(1, 64, (GLOBAL_BATCH, 8), generator=g)
    return images, tokens, torch.randperm(40, generator=g)[:GLOBAL_BATCH]


def _model(dropout: bool, logit_bias: float | None = None):
    import copy

    from toolkit.models.factory import build_model
    from toolkit.train.model import TrainModel

    cfg = copy.deepcopy(CFG)
    cfg["vision_cfg"]["patch_dropout"] = PATCH_DROPOUT if dropout else 0.0
    if logit_bias is not None:  # as train.model.build does for sigmoid losses
        cfg["init_logit_bias"] = logit_bias
    torch.manual_seed(0)
    clip = build_model(cfg)
    return TrainModel(clip, "image", "tokens", (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)).train()


def _setup(loss_name: str, rank: int, world: int, dropout: bool):
    from toolkit.core.config import build
    from toolkit.train.ddp import wrap_ddp
    from toolkit.train.losses import LossConfig, build_loss

    cfg = build(LossConfig, LOSSES[loss_name])
    model = _model(dropout, cfg.init_logit_bias)
    model.clip.logit_scale.requires_grad_(cfg.learns_logit_scale)  # as the trainer does (v1: τ constant)
    loss = build_loss(cfg, data_size=40)
    images, tokens, index = _batch()
    b = GLOBAL_BATCH // world
    mine = slice(rank * b, (rank + 1) * b)
    return model, wrap_ddp(model), loss, images[mine], tokens[mine], index[mine]


def _seed(rank: int):
    from toolkit.core.seeds import stream_seed

    return lambda i: stream_seed(3, 0, rank, i)


def grads(
    loss_name: str, micro: int, rank: int = 0, world: int = 1, dropout: bool = True
) -> dict[str, torch.Tensor]:
    """Parameter gradients after one cached (or plain, micro 0) step of this rank (module docstring)."""
    import contextlib

    from toolkit.train.step import StepInputs, forward_backward

    model, ddp, loss, images, tokens, index = _setup(loss_name, rank, world, dropout)
    forward_backward(
        ddp,
        loss,
        StepInputs(images, tokens, index),
        micro_batch_size=micro,
        seed_of=_seed(rank),
        autocast=contextlib.nullcontext,
    )
    return {n: p.grad.clone() for n, p in model.clip.named_parameters() if p.grad is not None}


def reference(loss_name: str, micro: int, dropout: bool = True) -> dict[str, torch.Tensor]:
    """One process, no cache: every micro-batch forward kept with its graph, one loss, one backward."""
    model, _, loss, images, tokens, index = _setup(loss_name, 0, 1, dropout)
    seed_of, feats = _seed(0), []
    for i, start in enumerate(range(0, GLOBAL_BATCH, micro)):
        torch.manual_seed(seed_of(i))
        feats.append(model(images[start : start + micro], tokens[start : start + micro]))
    x, y, scalars = torch.cat([f[0] for f in feats]), torch.cat([f[1] for f in feats]), feats[-1][2:]
    loss(x, y, scalars[0], index, logit_bias=scalars[1] if len(scalars) > 1 else None).backward()
    return {n: p.grad.clone() for n, p in model.clip.named_parameters() if p.grad is not None}


def _worker(out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {
        (name, micro): grads(name, micro, rank, world, dropout=False) for name in LOSSES for micro in (0, 2)
    }
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(_worker(sys.argv[1]) or 0) if os.environ.get("RANK") else None
