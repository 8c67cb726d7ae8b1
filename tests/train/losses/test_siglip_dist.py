"""The sigmoid loss across K = 2, 3, 4 real gloo processes equals one process on the global batch (fp64).

Reference (this process): open_clip's ``SigLipLoss`` on the concatenated global batch in float64, and the
documented convention (toolkit/train/losses/siglip/modes.py): rank r's share loss_r (its rows over every
column, over b), K·∂L/∂(its features), ∂loss_r/∂t and ∂loss_r/∂b. Every mode, the trainer's objective
and open_clip's own distributed SigLipLoss (bidir, gather) must give exactly that.
"""

from __future__ import annotations

import pytest
import torch
from open_clip.loss import SigLipLoss
from siglip_jobs import LOCAL_BATCHES, global_inputs, spawn_siglip_job

from toolkit.train.losses.siglip.modes import MODES
from toolkit.train.plan.traffic import step_traffic

pytestmark = pytest.mark.dist
TOL = 1e-9  # float64 parity target
VARIANTS = (*MODES, *(f"objective_{m}" for m in MODES), "open_clip_bidir", "open_clip_gather")


def rel_err(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda k: f"K{k}")
def job(request, tmp_path_factory):
    world = request.param
    return world, spawn_siglip_job(world, tmp_path_factory.mktemp(f"siglip{world}"))


def reference(b: int, world: int) -> dict:
    x, y, t, bias = (v.clone().requires_grad_() for v in global_inputs(b, world))
    total = SigLipLoss()(x, y, t, bias)  # open_clip, one process, global batch
    logits = t * x @ y.T + bias
    z = 2 * torch.eye(world * b, dtype=torch.float64) - 1
    terms = -torch.nn.functional.logsigmoid(z * logits)
    shares = [terms[r * b : (r + 1) * b].sum() / b for r in range(world)]
    assert rel_err(torch.stack(shares).mean().detach(), total.detach()) <= 1e-13
    dx, dy = torch.autograd.grad(world * total, (x, y), retain_graph=True)
    per_rank = [torch.autograd.grad(s, (t, bias), retain_graph=True) for s in shares]
    return {
        "loss": total.item(),
        "loss_r": [s.item() for s in shares],
        "dx": dx.chunk(world),
        "dy": dy.chunk(world),
        "dt_r": [g[0].item() for g in per_rank],
        "db_r": [g[1].item() for g in per_rank],
    }


def test_every_mode_equals_one_process_open_clip(job):
    world, ranks = job
    for b in LOCAL_BATCHES:
        ref = reference(b, world)
        for variant in VARIANTS:
            got = [res[(b, variant)] for res in ranks]
            assert rel_err(sum(g["loss"] for g in got) / world, ref["loss"]) <= TOL, (variant, b)
            for r, g in enumerate(got):
                where = (variant, b, r)
                assert rel_err(g["loss"], ref["loss_r"][r]) <= TOL, where
                assert rel_err(g["dx"], ref["dx"][r]) <= TOL, (*where, rel_err(g["dx"], ref["dx"][r]))
                assert rel_err(g["dy"], ref["dy"][r]) <= TOL, (*where, rel_err(g["dy"], ref["dy"][r]))
                assert rel_err(g["dt"], ref["dt_r"][r]) <= TOL, where
                assert rel_err(g["db"], ref["db_r"][r]) <= TOL, where


def test_ledger_matches_the_analytic_traffic(job):
    """What each mode hands to the collectives per rank: gather one text all_gather + one reduce_scatter,
    ring K−1 hops of text and of fp32 dy partials, fastclip one pair all_gather and no gradient traffic."""
    world, ranks = job
    for b in LOCAL_BATCHES:
        for mode in MODES:
            want = step_traffic(mode, world, b, 7, 0, feature_bytes=8, objective="siglip")
            want = {k: v for k, v in want.items() if k[1] != "param_grads"}  # no model here
            for res in ranks:
                led = res[(b, mode)]["ledger"]
                seen = {tuple(k.split("/")[1:3]) for k in led if k.endswith("/calls") and k.count("/") == 3}
                assert seen == set(want), (mode, seen ^ set(want))
                for (op, cat), (calls, nbytes) in want.items():
                    assert led[f"comm/{op}/{cat}/calls"] == calls, (mode, op, cat)
                    assert led[f"comm/{op}/{cat}/bytes"] == nbytes, (mode, op, cat)
