"""FastCLIP under torch.distributed (gloo, real processes on 127.0.0.1) equals the single-process run.

K=2 runs as two nodes of one rank (a table replica per rank); K=4 as two nodes of two local ranks
(one shared-memory table per node). Each job runs every version over several steps (γ = 1, then
decaying; local batch 1 included) plus the OpenCLIP baseline; the parent compares each rank's results
with a single-process run on the same global batches: values, K⁻¹ × the rank's feature gradients (what
DDP's mean makes of them), the mean over ranks of the p gradients, and every rank's full tables.
This file is also the worker script (``python test_fastclip_dist.py OUT_DIR``).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
from _launch import rank_main, run_rank_script
from fastclip_oracle import make_loss

N, D = 23, 5
# v3-drift: v3 with u_drift: batch (one more all_reduce); v3-scent: v3 with SCENT's per-sample update, and
# with the drift correction too (v3-scent-drift)
VERSIONS = ("v0", "v1", "v2", "v3", "v3-drift", "v3-scent", "v3-scent-drift")
VARIANTS = {"drift": {"u_drift": "batch"}, "scent": {"u_update": "scent", "scent_gamma": 0.5}}
LOCAL_BATCHES = (3, 1, 2)
KW = {
    "gamma_min": 0.3,
    "gamma_decay_epochs": 2,
    "rho": 6.5,
    "eps": 1e-14,
    "tau_init": 0.07,
    "lr_tau": 0.05,
    "tau_beta2": 0.98,
    "tau_eps": 1e-6,
    "table_dtype": torch.float64,
}


def scenario(num_ranks: int):
    """[(epoch, x [B,D], y [B,D], ids [B], p)] for B = K·b, b in LOCAL_BATCHES; fp64, seeded."""
    gen = torch.Generator().manual_seed(100 + num_ranks)
    steps = []
    for epoch, b in enumerate(LOCAL_BATCHES):
        B = num_ranks * b
        x = torch.nn.functional.normalize(torch.randn(B, D, generator=gen, dtype=torch.float64), dim=1)
        y = torch.nn.functional.normalize(
            x + 0.8 * torch.randn(B, D, generator=gen, dtype=torch.float64), dim=1
        )
        steps.append((epoch, x, y, torch.randperm(N, generator=gen)[:B], math.log(1 / 0.06) + 0.2 * epoch))
    return steps


def run(num_ranks: int, world: int, rank: int, group=None):
    """Every version over ``scenario(num_ranks)`` on this rank's rows out of ``world`` ranks (world 1: the
    single-process reference on the whole global batch); returns results per version."""
    from toolkit.train.losses import LossConfig, build_loss
    from toolkit.train.losses.modes import MODES

    out = {}
    for version in VERSIONS:
        name, *variants = version.split("-")
        loss = make_loss(
            name, N, group=group, **KW, **{k: v for var in variants for k, v in VARIANTS[var].items()}
        )
        records = []
        for epoch, x, y, ids, p0 in scenario(num_ranks):
            b = x.shape[0] // world
            rows = slice(rank * b, (rank + 1) * b)
            loss.set_epoch(epoch)
            xs, ys = x[rows].clone().requires_grad_(), y[rows].clone().requires_grad_()
            p = torch.tensor(p0, dtype=torch.float64, requires_grad=True)
            value = loss(xs, ys, p.exp(), ids[rows])
            value.backward()
            records.append({"value": value.detach(), "dx": xs.grad, "dy": ys.grad, "dp": p.grad})
        loss.sync_state()
        out[version] = {"steps": records, "tables": loss.tables.data.clone()}
    _, x, y, _, p0 = scenario(num_ranks)[0]
    b = x.shape[0] // world
    xs, ys = (
        x[rank * b : (rank + 1) * b].clone().requires_grad_(),
        y[rank * b : (rank + 1) * b].clone().requires_grad_(),
    )
    for mode in MODES:  # the baseline through build_loss in every mode: the same gradients
        xm, ym = xs.detach().clone().requires_grad_(), ys.detach().clone().requires_grad_()
        p = torch.tensor(p0, dtype=torch.float64, requires_grad=True)
        loss = build_loss(LossConfig(kind="openclip", mode=mode), group=group)
        loss(xm, ym, p.exp(), None).backward()
        out[f"openclip-{mode}"] = {"dx": xm.grad, "dp": p.grad, "value": loss.global_value()}
    if world > 1:  # rank 1 brings one more pair: every rank must refuse, naming the sizes
        loss, b = make_loss("v3", N, group=group, **KW), 2 + (rank == 1)
        try:
            loss(x[:b], y[:b], torch.tensor(10.0, dtype=torch.float64), torch.arange(rank * 3, rank * 3 + b))
            out["unequal"] = None
        except ValueError as err:
            out["unequal"] = str(err)
    return out


def _worker(out_dir: str) -> None:
    rank_main(run, out_dir)


def _launch(num_ranks: int, local_world: int, out_dir: Path) -> list[dict]:
    return run_rank_script(__file__, num_ranks, out_dir, local_world=local_world)


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=lambda m: f"{what}: {m}")


@pytest.mark.dist
@pytest.mark.parametrize("num_ranks,local_world", [(2, 1), (4, 2)])
def test_distributed_equals_single_process(tmp_path, num_ranks, local_world):
    ranks = _launch(num_ranks, local_world, tmp_path)
    expected = _single_process(num_ranks)
    for version in VERSIONS:
        for s, want in enumerate(expected[version]["steps"]):
            b = want["dx"].shape[0] // num_ranks
            for r, res in enumerate(ranks):
                got = res[version]["steps"][s]
                _close(got["value"], want["value"], f"{version} step {s} rank {r} value")
                _close(
                    got["dx"] / num_ranks, want["dx"][r * b : (r + 1) * b], f"{version} step {s} rank {r} dx"
                )
                _close(
                    got["dy"] / num_ranks, want["dy"][r * b : (r + 1) * b], f"{version} step {s} rank {r} dy"
                )
            if want["dp"] is None:
                assert all(res[version]["steps"][s]["dp"] is None for res in ranks)
            else:
                mean_dp = sum(res[version]["steps"][s]["dp"] for res in ranks) / num_ranks
                _close(mean_dp, want["dp"], f"{version} step {s} dp")
        for r, res in enumerate(ranks):
            _close(res[version]["tables"], expected[version]["tables"], f"{version} rank {r} tables")
    for mode in ("gather", "disco", "ring", "fastclip"):
        key, want = f"openclip-{mode}", expected["openclip-gather"]  # world 1: every mode is one clip loss
        b = want["dx"].shape[0] // num_ranks
        for r, res in enumerate(ranks):
            _close(res[key]["dx"] / num_ranks, want["dx"][r * b : (r + 1) * b], f"{key} rank {r} dx")
            _close(res[key]["value"], want["value"], f"{key} rank {r} global value")
        _close(sum(res[key]["dp"] for res in ranks) / num_ranks, want["dp"], f"{key} dp")
    for r, res in enumerate(ranks):
        assert res["unequal"] is not None and "rank 1: [3," in res["unequal"], f"rank {r}: {res['unequal']}"


def _single_process(num_ranks: int) -> dict:
    """The same global batches without a process group (rank 0 of 1 sees the whole batch)."""
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    try:
        return run(num_ranks, 1, 0)
    finally:
        os.environ.update(saved)


if __name__ == "__main__":
    _worker(sys.argv[1])
