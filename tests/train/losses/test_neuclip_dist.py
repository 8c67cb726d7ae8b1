"""NeuCLIP under torch.distributed (gloo, real processes on 127.0.0.1) equals the single-process run.

K=2 and K=4 ranks run four steps of one NeuCLIPLoss (local batches 3, 1, 2, 3: batch 1 included; a restart
at step 2) and compare each rank's results with a single process on the same global batches: values,
K⁻¹ × the rank's feature gradients (what DDP's mean makes of them), the mean over ranks of the p
gradients, and the network (prototypes and AdaGrad sums) after every update, on every rank. The step is
the fastclip mode's: the features are gathered without autograd and no feature gradient crosses ranks.
This file is also the worker script (``python test_neuclip_dist.py OUT_DIR``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from _launch import rank_main, run_rank_script
from neuclip_oracle import p_of, unit_pairs

DIM, PROTOTYPES = 5, 10  # K=2: the first batches are smaller than m (the start spreads over batches)
LOCAL_BATCHES = (3, 1, 2, 3)
TAUS = (0.07, 0.05, 0.1, 0.03)


def scenario(num_ranks: int):
    gen = torch.Generator().manual_seed(200 + num_ranks)
    return [unit_pairs(num_ranks * b, DIM, gen) for b in LOCAL_BATCHES]


def run(num_ranks: int, world: int, rank: int, group=None) -> list[dict]:
    """Every step on this rank's rows out of ``world`` (world 1: the whole global batch)."""
    from toolkit.train.losses import LossConfig, build_loss
    from toolkit.train.losses.config import NeuCLIPConfig

    cfg = LossConfig(
        kind="neuclip",
        rho=6.5,
        eps=1e-6,
        neuclip=NeuCLIPConfig(num_prototypes=PROTOTYPES, lr=0.05, inner_steps=3, restart_every_steps=2),
    )
    loss = build_loss(cfg, group=group)
    records = []
    for step, ((x, y), tau) in enumerate(zip(scenario(num_ranks), TAUS, strict=True)):
        b = x.shape[0] // world
        rows = slice(rank * b, (rank + 1) * b)
        loss.begin_step(step, 2)
        xs, ys = x[rows].clone().requires_grad_(), y[rows].clone().requires_grad_()
        p = torch.tensor(p_of(tau), dtype=torch.float64, requires_grad=True)
        value = loss(xs, ys, p.exp(), torch.arange(b))
        value.backward()
        loss.end_step(True)
        records.append(
            {
                "value": value.detach(),
                "global": loss.global_value(),
                "dx": xs.grad,
                "dy": ys.grad,
                "dp": p.grad,
                "metrics": loss.metrics(),
                **loss.state_dict(),
            }
        )
    return records


def _worker(out_dir: str) -> None:
    rank_main(run, out_dir)


def _launch(num_ranks: int, out_dir: Path) -> list[list[dict]]:
    return run_rank_script(__file__, num_ranks, out_dir)


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=lambda m: f"{what}: {m}")


@pytest.mark.dist
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_distributed_equals_single_process(tmp_path, num_ranks):
    ranks = _launch(num_ranks, tmp_path)
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    try:
        expected = run(num_ranks, 1, 0)
    finally:
        os.environ.update(saved)
    for s, want in enumerate(expected):
        b = want["dx"].shape[0] // num_ranks
        for r, res in enumerate(ranks):
            got = res[s]
            for key in ("value", "global", "network.weight", "network.sumsq"):
                _close(got[key], want[key], f"step {s} rank {r} {key}")
            _close(got["dx"] / num_ranks, want["dx"][r * b : (r + 1) * b], f"step {s} rank {r} dx")
            _close(got["dy"] / num_ranks, want["dy"][r * b : (r + 1) * b], f"step {s} rank {r} dy")
            assert got["metrics"]["normaliser_error"] == pytest.approx(
                want["metrics"]["normaliser_error"], rel=1e-9
            )
        _close(sum(res[s]["dp"] for res in ranks) / num_ranks, want["dp"], f"step {s} dp")


if __name__ == "__main__":
    _worker(sys.argv[1])
