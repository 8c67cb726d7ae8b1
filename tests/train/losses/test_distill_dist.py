"""The distill objective under torch.distributed (gloo, real processes on 127.0.0.1) equals one process.

K = 2 and K = 4 ranks evaluate, in the gather and fastclip modes, the objective on their slices of fixed
float64 global batches (local batch 1 and 3; teacher width 4, student width 6) and are compared with one
process on the whole batch: the mean of the ranks' shares and every rank's ``global_value()`` with the value,
K⁻¹ × each rank's feature gradients (what DDP's mean makes of them) with its rows of the gradient, the mean
of the p gradients with p's. At K = 2 the ranks also take a real ``forward_backward`` of a small CLIP through
DDP with micro-batches of 2 (2, 2, 1 per rank), whose parameter gradients must equal one process's without
the cache. This file is also the ranks' script (``python test_distill_dist.py OUT_DIR``).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
from _launch import run_rank_script
from distill_oracle import inputs

from toolkit.core import dist as D
from toolkit.train.plan.traffic import step_traffic

LOCAL_BATCHES = (1, 3)
MODES = ("gather", "fastclip")
DIM, D_REF = 6, 4


def objective(mode: str):
    from toolkit.train.losses import LossConfig, build_loss
    from toolkit.train.losses.distill.config import DistillConfig

    return build_loss(
        LossConfig(kind="distill", mode=mode, distill=DistillConfig(weight=0.6, teacher_tau=0.04))
    )


def features_step(mode: str, b: int, num_ranks: int, rank: int, world: int) -> dict:
    """This rank's rows (world 1: all of them) of the global batch of ``num_ranks`` × b pairs."""
    x, y, u, v, p = inputs(num_ranks * b, DIM, D_REF, seed=40 * num_ranks + b)
    n = x.shape[0] // world
    rows = slice(rank * n, (rank + 1) * n)
    loss = objective(mode)
    xs, ys = x[rows].clone().requires_grad_(), y[rows].clone().requires_grad_()
    ps = p.clone().requires_grad_()
    D.LEDGER.reset()
    value = loss(xs, ys, ps.exp(), torch.arange(n), reference=(u[rows], v[rows]))
    value.backward()
    ledger = D.LEDGER.step()  # the step's collectives, before global_value's scalar all_reduce
    return {
        "value": value.detach(),
        "global": loss.global_value(),
        "dx": xs.grad,
        "dy": ys.grad,
        "dp": ps.grad,
        "ledger": ledger,
    }


def model_step(mode: str, micro: int, rank: int, world: int) -> dict:
    """Parameter gradients after one ``forward_backward`` of this rank's slice (DDP-averaged when world >
    1)."""
    from gradcache_jobs import GLOBAL_BATCH, _batch, _model, _seed

    from toolkit.train.ddp import wrap_ddp
    from toolkit.train.step import StepInputs, forward_backward

    model = _model(dropout=False)
    images, tokens, index = _batch()
    _, _, u, v, _ = inputs(GLOBAL_BATCH, DIM, 12, seed=77)
    n = GLOBAL_BATCH // world
    rows = slice(rank * n, (rank + 1) * n)
    step = StepInputs(images[rows], tokens[rows], index[rows], reference=(u[rows].float(), v[rows].float()))
    forward_backward(
        wrap_ddp(model),
        objective(mode),
        step,
        micro_batch_size=micro,
        seed_of=_seed(rank),
        autocast=contextlib.nullcontext,
    )
    return {n: p.grad.clone() for n, p in model.clip.named_parameters() if p.grad is not None}


def _worker(out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    rank, k = dist.get_rank(), dist.get_world_size()
    results = {(mode, b): features_step(mode, b, k, rank, k) for mode in MODES for b in LOCAL_BATCHES}
    if k == 2:
        results |= {(mode, "model"): model_step(mode, 2, rank, k) for mode in MODES}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def _launch(num_ranks: int, out_dir: Path) -> list[dict]:
    return run_rank_script(__file__, num_ranks, out_dir, timeout_s=300)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """num_ranks -> the ranks' results, each job launched once for this file's tests."""
    jobs: dict[int, list[dict]] = {}

    def get(num_ranks: int) -> list[dict]:
        if num_ranks not in jobs:
            jobs[num_ranks] = _launch(num_ranks, tmp_path_factory.mktemp(f"distill_k{num_ranks}"))
        return jobs[num_ranks]

    return get


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=lambda m: f"{what}: {m}")


def _rel(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-12)).item() for k in want)


@pytest.mark.dist
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_distributed_equals_single_process(launched, num_ranks):
    ranks = launched(num_ranks)
    for mode in MODES:
        for b in LOCAL_BATCHES:
            want = features_step(mode, b, num_ranks, 0, 1)
            what = f"{mode} b={b}"
            _close(
                sum(res[(mode, b)]["value"] for res in ranks) / num_ranks, want["value"], f"{what} mean share"
            )
            _close(sum(res[(mode, b)]["dp"] for res in ranks) / num_ranks, want["dp"], f"{what} dp")
            for r, res in enumerate(ranks):
                got = res[(mode, b)]
                _close(got["global"], want["value"], f"{what} rank {r} global_value")
                _close(got["dx"] / num_ranks, want["dx"][r * b : (r + 1) * b], f"{what} rank {r} dx")
                _close(got["dy"] / num_ranks, want["dy"][r * b : (r + 1) * b], f"{what} rank {r} dy")
        if num_ranks == 2:  # the trainer's step: DDP, the gradient cache, reference rows per rank
            want = model_step(mode, 0, 0, 1)
            for r, res in enumerate(ranks):
                assert _rel(res[(mode, "model")], want) <= 1e-5, (mode, r)


@pytest.mark.dist
def test_ledger_matches_the_analytic_traffic(launched):
    """What each mode hands to the collectives per rank (2 ranks) is what ``toolkit plan`` counts
    (losses/distill/spec.py), whose teacher pairs have width d: here they are D_REF wide."""
    ranks = launched(2)
    for mode in MODES:
        for b in LOCAL_BATCHES:
            want = step_traffic(mode, 2, b, DIM, 0, feature_bytes=8, objective="distill")
            want = {k: v for k, v in want.items() if k[1] != "param_grads"}  # no model here
            calls, nbytes = want[("all_gather", "features")]
            want[("all_gather", "features")] = (calls, nbytes + 2 * b * (D_REF - DIM) * 8)
            for res in ranks:
                led = res[(mode, b)]["ledger"]
                seen = {tuple(k.split("/")[1:3]) for k in led if k.endswith("/calls") and k.count("/") == 3}
                assert seen == set(want), (mode, seen ^ set(want))
                for (op, cat), (calls, nbytes) in want.items():
                    assert led[f"comm/{op}/{cat}/calls"] == calls, (mode, b, op, cat)
                    assert led[f"comm/{op}/{cat}/bytes"] == nbytes, (mode, b, op, cat)


if __name__ == "__main__":
    _worker(sys.argv[1])
