"""Distributed contrastive modes and DDP gradient communication on real gloo processes (K=2, K=4).

One spawned job per world size runs every check (see _dist_jobs.py); the tests compare its per-rank
results with K=1 references on the concatenated global batch computed here.
"""

from __future__ import annotations

import math

import pytest
import torch
from _dist_jobs import (
    FEATURE_BATCHES,
    LOCAL_BATCH,
    MODES,
    SEEDS,
    global_batch,
    global_features,
    make_model,
    spawn_job,
)

from toolkit.core.dist import wire_bytes
from toolkit.kernels.naive import clip_loss
from toolkit.train.plan.traffic import step_traffic

pytestmark = pytest.mark.dist
TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.fixture(scope="module", params=[2, 4], ids=lambda k: f"K{k}")
def job(request, tmp_path_factory):
    world = request.param
    return world, spawn_job(world, tmp_path_factory.mktemp(f"world{world}"))


def model_reference(world: int, seeds=("batch",)) -> tuple[float, dict[str, torch.Tensor]]:
    """K=1: the summed loss and parameter gradients over the given global batches."""
    model = make_model()
    total = 0.0
    for name in seeds:
        img, txt = global_batch(SEEDS[name], world * LOCAL_BATCH)
        loss = clip_loss(*model(img, txt))
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def feature_reference(b: int, world: int) -> dict:
    """Global loss L, and per rank: loss_r, K·∂L/∂(local features), ∂loss_r/∂a (the documented convention),
    in float64 from the fp32 inputs. ``loss_scale`` = a + log B bounds the LSE terms whose differences form
    the loss (a small loss_r is a cancellation, so its error is measured against the terms); the
    logit_scale gradient's terms are similarities, bounded by 1."""
    x, y, a = (t.double().requires_grad_() for t in global_features(b, world))
    logits = a * x @ y.T
    row, col, pos = logits.logsumexp(1), logits.logsumexp(0), logits.diagonal()
    per_rank = [
        0.5 * (row[s] - pos[s]).mean() + 0.5 * (col[s] - pos[s]).mean()
        for s in (slice(r * b, (r + 1) * b) for r in range(world))
    ]
    total = torch.stack(per_rank).mean()
    assert rel_err(total, clip_loss(x, y, a)) <= TOL  # the objective is open_clip's on the global batch
    dx, dy = torch.autograd.grad(world * total, (x, y), retain_graph=True)
    das = [torch.autograd.grad(lr, a, retain_graph=True)[0].item() for lr in per_rank]
    return {
        "loss": total.item(),
        "loss_r": [v.item() for v in per_rank],
        "da_r": das,
        "loss_scale": a.item() + math.log(world * b),
        "dx": dx.chunk(world),
        "dy": dy.chunk(world),
        "da": torch.autograd.grad(total, a)[0].item(),
    }


def test_every_mode_matches_k1_after_ddp(job):
    world, ranks = job
    ref_loss, ref_grads = model_reference(world)
    for mode in MODES:
        for r, res in enumerate(ranks):
            got = res["model"][mode]
            assert abs(got["loss"] - ref_loss) <= TOL * abs(ref_loss), (mode, r)
            for name, g in got["grads"].items():
                assert rel_err(g, ref_grads[name]) <= TOL, (mode, r, name, rel_err(g, ref_grads[name]))
    assert "logit_scale" in ref_grads and ref_grads["logit_scale"].abs() > 0


def test_feature_gradients_follow_the_scale_convention(job):
    world, ranks = job
    for b in FEATURE_BATCHES:
        ref = feature_reference(b, world)
        for mode in MODES:
            got = [res["features"][(b, mode)] for res in ranks]
            assert abs(sum(g["loss"] for g in got) / world - ref["loss"]) <= TOL * abs(ref["loss"])
            for r, g in enumerate(got):
                assert abs(g["loss"] - ref["loss_r"][r]) <= TOL * ref["loss_scale"], (mode, b, r)
                assert rel_err(g["dx"], ref["dx"][r]) <= TOL, (mode, b, r, rel_err(g["dx"], ref["dx"][r]))
                assert rel_err(g["dy"], ref["dy"][r]) <= TOL, (mode, b, r, rel_err(g["dy"], ref["dy"][r]))
                assert abs(g["da"] - ref["da_r"][r]) <= TOL * max(abs(ref["da_r"][r]), 1.0), (mode, b, r)
            assert abs(sum(g["da"] for g in got) / world - ref["da"]) <= TOL * max(abs(ref["da"]), 1.0)


def test_bf16_gradient_allreduce(job):
    world, ranks = job
    _, ref_grads = model_reference(world)
    num_params = sum(g.numel() for g in ref_grads.values())
    for mode in ("gather", "fastclip"):
        for res in ranks:
            got = res["model_bf16"][mode]
            for name, g in got["grads"].items():
                # The average came back through bf16: every value is a bf16 number, close to fp32's.
                assert torch.equal(g, g.to(torch.bfloat16).float()), name
                assert rel_err(g, ref_grads[name]) <= 2**-6 * world, (mode, name)
            assert got["ledger"]["comm/all_reduce/param_grads/bytes"] == 2 * num_params
            fp32 = res["model"][mode]["ledger"]["comm/all_reduce/param_grads/bytes"]
            assert fp32 == 4 * num_params


def test_no_sync_on_accumulation_micro_steps(job):
    world, ranks = job
    _, ref_grads = model_reference(world, seeds=("micro1", "micro2"))
    num_params = sum(g.numel() for g in ref_grads.values())
    micro1 = [res["no_sync"]["micro1_grads"] for res in ranks]
    for res in ranks:
        assert not any("param_grads" in k for k in res["no_sync"]["micro1_ledger"])
        assert res["no_sync"]["micro2_ledger"]["comm/all_reduce/param_grads/bytes"] == 4 * num_params
        for name, g in res["no_sync"]["micro2_grads"].items():
            assert rel_err(g, ref_grads[name]) <= TOL, name
    # Without sync each rank kept its own gradient of its own shard: they differ.
    assert any(rel_err(micro1[0][n], micro1[1][n]) > 1e-3 for n in micro1[0])


def test_unequal_batches_refused_on_every_rank(job):
    world, ranks = job
    for res in ranks:
        for what, msg in res["unequal"].items():
            assert msg is not None, f"{what} accepted unequal batches"
            assert "rank 0: [3, 7]" in msg and "rank 1: [4, 7]" in msg and f"rank {world - 1}:" in msg, msg


def test_ledger_matches_the_analytic_formula(job):
    world, ranks = job
    _, ref_grads = model_reference(world)
    num_params = sum(g.numel() for g in ref_grads.values())
    for mode in MODES:
        want = step_traffic(mode, world, LOCAL_BATCH, 8, num_params)  # the docs/distributed.md table
        for res in ranks:
            led = res["model"][mode]["ledger"]
            seen = {tuple(k.split("/")[1:3]) for k in led if k.endswith("/calls") and k.count("/") == 3}
            assert seen == set(want), (mode, seen ^ set(want))
            total_sent = 0.0
            for (op, cat), (calls, nbytes) in want.items():
                got_calls = led[f"comm/{op}/{cat}/calls"]
                assert got_calls == calls if calls is not None else got_calls >= 1, (mode, op, cat)
                assert led[f"comm/{op}/{cat}/bytes"] == nbytes, (mode, op, cat)
                sent = wire_bytes(op, nbytes, world)
                assert led[f"comm/{op}/{cat}/sent_bytes"] == pytest.approx(sent, rel=1e-12), (mode, op, cat)
                total_sent += sent
            assert led["comm/total/sent_bytes"] == pytest.approx(total_sent, rel=1e-12)


def test_ledger_feature_bytes_fastclip_half_of_gather(job):
    world, ranks = job
    led = {m: ranks[0]["model"][m]["ledger"] for m in MODES}
    feat = {
        m: led[m].get("comm/category/features/sent_bytes", 0)
        + led[m].get("comm/category/feature_grads/sent_bytes", 0)
        for m in MODES
    }
    assert feat["fastclip"] == pytest.approx(0.5 * feat["gather"])
    assert feat["disco"] == pytest.approx(feat["gather"])


def test_modes_on_subgroups(job):
    """Groups of size 1 (each rank alone: no communication) and, at K=4, two groups of size 2."""
    world, ranks = job
    for size in (1, 2) if world == 4 else (1,):
        ref = feature_reference(LOCAL_BATCH, size)
        for mode in MODES:
            for res in ranks:
                got = res["subgroups"][(size, mode)]
                r = got["sub_rank"]
                assert abs(got["loss"] - ref["loss_r"][r]) <= TOL * ref["loss_scale"], (size, mode)
                assert rel_err(got["dx"], ref["dx"][r]) <= TOL and rel_err(got["dy"], ref["dy"][r]) <= TOL
                assert abs(got["da"] - ref["da_r"][r]) <= TOL * max(abs(ref["da_r"][r]), 1.0)
