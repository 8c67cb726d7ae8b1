"""DRRho-CLIP under torch.distributed (gloo, real processes on 127.0.0.1) equals the single-process run.

As test_fastclip_dist.py (whose launch helpers it shares): K=2 as two nodes of one rank, K=4 as two nodes of
two local ranks (one shared-memory table per node); several steps (γ = 1, then decaying; local batch 1
included), reference width ≠ student width. Each rank's value, K⁻¹ × its feature gradients, the mean over
ranks of the p gradients and every rank's full tables equal the single-process run on the same global batches,
which itself equals the float64 oracle of the paper's formula (test_drrho.py). The collectives the ledger
counts equal the spec's traffic (``toolkit plan``). This file is also the worker script (``python
test_drrho_dist.py OUT_DIR``).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
from _launch import rank_main, run_rank_script
from torch.nn.functional import normalize

N, D, D_REF = 23, 5, 3
LOCAL_BATCHES = (3, 1, 2)
KW = {"gamma_min": 0.3, "gamma_decay_epochs": 2, "rho": 6.5, "eps": 1e-14}
VARIANTS = {"paper": {}, "half-ref-fixed-tau": {"ref_weight": 0.5, "learn_tau": False}}


def _sectioned(fields: dict) -> dict:
    """FastCLIP's knobs among ``fields`` (``gamma_min``, ``version``, ...) in their ``loss.fastclip``
    section."""
    import dataclasses

    from toolkit.train.losses.fastclip.config import FastCLIPConfig

    own = {f.name for f in dataclasses.fields(FastCLIPConfig)}
    rest = {k: v for k, v in fields.items() if k not in own}
    return {**rest, "fastclip": {**rest.get("fastclip", {}), **{k: v for k, v in fields.items() if k in own}}}


def scenario(num_ranks: int):
    """[(epoch, x, y [B, D] fp64, ref_image, ref_text [B, D_REF] fp32, ids [B], p)] for B = K·b; seeded."""
    gen = torch.Generator().manual_seed(200 + num_ranks)
    steps = []
    for epoch, b in enumerate(LOCAL_BATCHES):
        B = num_ranks * b
        x = normalize(torch.randn(B, D, generator=gen, dtype=torch.float64), dim=1)
        y = normalize(x + 0.8 * torch.randn(B, D, generator=gen, dtype=torch.float64), dim=1)
        xr = normalize(torch.randn(B, D_REF, generator=gen), dim=1)
        yr = normalize(xr + 0.5 * torch.randn(B, D_REF, generator=gen), dim=1)
        steps.append(
            (epoch, x, y, xr, yr, torch.randperm(N, generator=gen)[:B], math.log(1 / 0.06) + 0.2 * epoch)
        )
    return steps


def make(group, ref_weight: float = 1.0, learn_tau: bool = True):
    from toolkit.core.config import build
    from toolkit.train.losses import LossConfig, build_loss

    cfg = build(
        LossConfig,
        _sectioned({"kind": "drrho", "learn_tau": learn_tau, "drrho": {"ref_weight": ref_weight}, **KW}),
    )
    return build_loss(cfg, data_size=N, group=group, table_dtype=torch.float64, check_sizes=False)


def run(num_ranks: int, world: int, rank: int, group=None) -> dict:
    """Every variant over ``scenario(num_ranks)`` on this rank's rows out of ``world`` ranks (world 1: the
    whole global batch on one process); plus, on K > 1, the ledger of one step."""
    from toolkit.core import dist as D

    out = {}
    for name, variant in VARIANTS.items():
        loss = make(group, **variant)
        records = []
        for epoch, x, y, xr, yr, ids, p0 in scenario(num_ranks):
            b = x.shape[0] // world
            rows = slice(rank * b, (rank + 1) * b)
            loss.set_epoch(epoch)
            xs, ys = x[rows].clone().requires_grad_(), y[rows].clone().requires_grad_()
            p = torch.tensor(p0, dtype=torch.float64, requires_grad=True)
            D.LEDGER.reset()
            value = loss(xs, ys, p.exp(), ids[rows], reference=(xr[rows], yr[rows]))
            ledger = D.LEDGER.step()
            value.backward()
            records.append(
                {"value": value.detach(), "dx": xs.grad, "dy": ys.grad, "dp": p.grad, "ledger": ledger}
            )
        loss.sync_state()
        out[name] = {"steps": records, "tables": loss.tables.data.clone()}
    return out


def _worker(out_dir: str) -> None:
    rank_main(run, out_dir)


def _launch(num_ranks: int, local_world: int, out_dir: Path) -> list[dict]:
    return run_rank_script(__file__, num_ranks, out_dir, local_world=local_world)


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=lambda m: f"{what}: {m}")


def _single_process(num_ranks: int) -> dict:
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    try:
        return run(num_ranks, 1, 0)
    finally:
        os.environ.update(saved)


@pytest.mark.dist
@pytest.mark.parametrize("num_ranks,local_world", [(2, 1), (4, 2)])
def test_distributed_equals_single_process(tmp_path, num_ranks, local_world):
    from toolkit.train.losses import registry

    ranks = _launch(num_ranks, local_world, tmp_path)
    expected = _single_process(num_ranks)
    for name in VARIANTS:
        for s, want in enumerate(expected[name]["steps"]):
            b = want["dx"].shape[0] // num_ranks
            # the ledger counts what the spec says (fp64 rows here: 8 bytes an element)
            traffic = registry.spec("drrho").traffic("fastclip", num_ranks, b, D, 8, {"ref_dim": D_REF})
            for r, res in enumerate(ranks):
                got = res[name]["steps"][s]
                _close(got["value"], want["value"], f"{name} step {s} rank {r} value")
                _close(got["dx"] / num_ranks, want["dx"][r * b : (r + 1) * b], f"{name} step {s} rank {r} dx")
                _close(got["dy"] / num_ranks, want["dy"][r * b : (r + 1) * b], f"{name} step {s} rank {r} dy")
                for (op, cat), (calls, nbytes) in traffic.items():
                    assert got["ledger"][f"comm/{op}/{cat}/calls"] == calls, (name, s, r, op, cat)
                    assert got["ledger"][f"comm/{op}/{cat}/bytes"] == nbytes, (name, s, r, op, cat)
            if want["dp"] is None:
                assert all(res[name]["steps"][s]["dp"] is None for res in ranks)
            else:
                _close(
                    sum(res[name]["steps"][s]["dp"] for res in ranks) / num_ranks,
                    want["dp"],
                    f"{name} {s} dp",
                )
        for r, res in enumerate(ranks):
            _close(res[name]["tables"], expected[name]["tables"], f"{name} rank {r} tables")


if __name__ == "__main__":
    _worker(sys.argv[1])
