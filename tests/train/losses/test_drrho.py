"""DRRhoLoss (``--loss drrho``) against the float64 oracle of the paper's formula
(tests/train/drrho_oracle.py): values, gradients wrt both feature sets and p, the estimator tables over
epochs; odd sizes, reference width ≠ student width, β ≠ 1, fixed τ; resume from its state_dict; the Triton
backend under TRITON_INTERPRET=1."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from drrho_oracle import DRRhoOracle
from torch.nn.functional import normalize

from toolkit.core.config import build
from toolkit.train.losses import LossConfig, build_loss, loss_fields
from toolkit.train.losses.drrho.loss import DRRhoLoss
from toolkit.train.losses.fastclip.schedules import gamma_at_epoch

N, D, D_REF = 13, 5, 3  # reference width ≠ student width on purpose
KW = {"rho": 6.5, "eps": 1e-14, "gamma_min": 0.3, "gamma_decay_epochs": 2}


def _sectioned(fields: dict) -> dict:
    """FastCLIP's knobs among ``fields`` (``gamma_min``, ``version``, ...) in their ``loss.fastclip``
    section."""
    import dataclasses

    from toolkit.train.losses.fastclip.config import FastCLIPConfig

    own = {f.name for f in dataclasses.fields(FastCLIPConfig)}
    rest = {k: v for k, v in fields.items() if k not in own}
    return {**rest, "fastclip": {**rest.get("fastclip", {}), **{k: v for k, v in fields.items() if k in own}}}


def make_drrho(data_size: int = N, *, group=None, ref_weight: float = 1.0, **fields) -> DRRhoLoss:
    cfg = build(
        LossConfig, _sectioned({**loss_fields("drrho"), **KW, **fields, "drrho": {"ref_weight": ref_weight}})
    )
    return build_loss(cfg, data_size=data_size, group=group, table_dtype=torch.float64)


def make_pairs(gen: torch.Generator, b: int) -> tuple[torch.Tensor, ...]:
    """Student features x, y [b, D] (fp64) and reference features [b, D_REF] (fp32, as the loader's),
    correlated pairs so that the excess loss is not symmetric around 0."""
    x = normalize(torch.randn(b, D, generator=gen, dtype=torch.float64), dim=1)
    y = normalize(x + 0.8 * torch.randn(b, D, generator=gen, dtype=torch.float64), dim=1)
    xr = normalize(torch.randn(b, D_REF, generator=gen), dim=1)
    yr = normalize(xr + 0.5 * torch.randn(b, D_REF, generator=gen), dim=1)
    return x, y, xr, yr


def run_against_oracle(batch_sizes=(7, 5, 7, 2, 7, 3), steps_per_epoch=2, ref_weight=1.0, learn_tau=True):
    loss = make_drrho(ref_weight=ref_weight, learn_tau=learn_tau)
    oracle = DRRhoOracle(N, rho=KW["rho"], eps=KW["eps"], ref_weight=ref_weight)
    gen = torch.Generator().manual_seed(7)
    for step, b in enumerate(batch_sizes):
        epoch = step // steps_per_epoch
        loss.set_epoch(epoch)
        oracle.gamma = gamma_at_epoch(epoch, KW["gamma_min"], KW["gamma_decay_epochs"], "cosine")
        x, y, xr, yr = make_pairs(gen, b)
        ids = torch.randperm(9 if epoch == 0 else N, generator=gen)[:b]  # ids 9.. first seen while γ < 1
        p = torch.tensor(math.log(1 / 0.05) + 0.1 * step, dtype=torch.float64)
        xs, ys, ps = (t.clone().requires_grad_() for t in (x, y, p))
        xo, yo, po = (t.clone().requires_grad_() for t in (x, y, p))
        got = loss(xs, ys, ps.exp(), ids, reference=(xr, yr))
        got.backward()
        want = oracle.step(xo, yo, xr, yr, ids, po)
        torch.testing.assert_close(got.detach(), want, rtol=1e-10, atol=0)
        torch.testing.assert_close(xs.grad, xo.grad, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(ys.grad, yo.grad, rtol=1e-9, atol=1e-12)
        if learn_tau:
            torch.testing.assert_close(ps.grad, po.grad, rtol=1e-9, atol=1e-12)
        else:
            assert ps.grad is None
        for side, u in (("image", oracle.u_im), ("text", oracle.u_tt)):
            seen = u > 0
            torch.testing.assert_close(loss.table(f"u_{side}")[seen], u[seen], rtol=1e-10, atol=0)
            assert torch.isneginf(loss.table(f"log_u_{side}")[~seen]).all()
    assert loss.gamma < 1  # the decaying γ was exercised


def test_matches_paper_formula_over_epochs():
    run_against_oracle()


@pytest.mark.parametrize("ref_weight,learn_tau", [(0.5, True), (1.0, False), (0.0, True)])
def test_ref_weight_and_fixed_tau_match_oracle(ref_weight, learn_tau):
    run_against_oracle(ref_weight=ref_weight, learn_tau=learn_tau)


def test_without_reference_is_fastclip_v3_with_doubled_feature_gradient():
    """β = 0 removes the reference: the same tables and value as FastCLIP v3, feature gradients 2×, p's equal
    (the authors' SogCLRLoss against fast_clip's split loss; drrho/loss.py)."""
    from fastclip_oracle import make_loss

    gen = torch.Generator().manual_seed(3)
    ours, v3 = make_drrho(ref_weight=0.0), make_loss("v3", N, table_dtype=torch.float64, **KW)
    x, y, xr, yr = make_pairs(gen, 6)
    ids, p = torch.arange(6), torch.tensor(math.log(1 / 0.05), dtype=torch.float64)
    grads = []
    for loss, kw in ((ours, {"reference": (xr, yr)}), (v3, {})):
        xs, ys, ps = (t.clone().requires_grad_() for t in (x, y, p))
        value = loss(xs, ys, ps.exp(), ids, **kw)
        value.backward()
        grads.append((value.detach(), xs.grad, ys.grad, ps.grad))
    (v_d, dx_d, dy_d, dp_d), (v_3, dx_3, dy_3, dp_3) = grads
    torch.testing.assert_close(v_d, v_3, rtol=1e-12, atol=0)
    torch.testing.assert_close(dx_d, 2 * dx_3, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(dy_d, 2 * dy_3, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(dp_d, dp_3, rtol=1e-12, atol=1e-15)
    assert torch.equal(ours.tables.data, v3.tables.data)


def test_torch_tiled_backend_with_fp32_features_matches_naive():
    """The chunked torch backend (tiles smaller than the batch) against the full-matrix one, fp32 features."""
    gen = torch.Generator().manual_seed(5)
    x, y, xr, yr = make_pairs(gen, 37)
    out = []
    for backend in ("naive", "torch"):
        loss = make_drrho(backend=backend, data_size=40)
        xs, ys = x.float().requires_grad_(), y.float().requires_grad_()
        value = loss(xs, ys, torch.tensor(20.0), torch.arange(37), reference=(xr, yr))
        value.backward()
        out.append((value.detach(), xs.grad, ys.grad))
    for got, want in zip(out[1], out[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_state_dict_resume_is_exact():
    """Two steps, save, a fresh loss loads the state: the third step is identical (value, gradients,
    tables)."""
    gen = torch.Generator().manual_seed(11)
    batches = [(*make_pairs(gen, 5), torch.randperm(N, generator=gen)[:5]) for _ in range(3)]
    first = make_drrho()
    for epoch, (x, y, xr, yr, ids) in enumerate(batches[:2]):
        first.set_epoch(epoch)
        first(x, y, torch.tensor(15.0, dtype=torch.float64), ids, reference=(xr, yr))
    first.sync_state()
    state = first.state_dict()
    assert set(state) == {"tables.log_u_image", "tables.log_u_text"}
    resumed = make_drrho()
    resumed.load_state_dict(state)
    assert torch.equal(resumed.tables.data, first.tables.data)
    out = []
    x, y, xr, yr, ids = batches[2]
    for loss in (first, resumed):
        loss.set_epoch(2)
        xs = x.clone().requires_grad_()
        value = loss(xs, y, torch.tensor(15.0, dtype=torch.float64), ids, reference=(xr, yr))
        value.backward()
        out.append((value.detach(), xs.grad, loss.tables.data.clone()))
    for got, want in zip(out[1], out[0], strict=True):
        assert torch.equal(got, want)


def test_refuses_bad_input_naming_it():
    loss = make_drrho()
    x, y, xr, yr = make_pairs(torch.Generator().manual_seed(0), 4)
    a, ids = torch.tensor(10.0, dtype=torch.float64), torch.arange(4)
    with pytest.raises(ValueError, match="reference model's features"):
        loss(x, y, a, ids)
    with pytest.raises(ValueError, match=r"\[b, d_ref\] with b = 4"):
        loss(x, y, a, ids, reference=(xr[:3], yr[:3]))
    with pytest.raises(ValueError, match="ref_image"):
        loss(x, y, a, ids, reference=xr)
    with pytest.raises(ValueError, match="at least 2 pairs"):  # batch 1 on one process: no negatives
        loss(x[:1], y[:1], a, ids[:1], reference=(xr[:1], yr[:1]))
    with pytest.raises(ValueError, match="v3"):
        make_drrho(version="v1")
    with pytest.raises(ValueError, match="fastclip mode only"):
        LossConfig(kind="drrho", mode="gather")


def test_registry_plan_and_config():
    from toolkit.train.losses import registry
    from toolkit.train.plan.traffic import step_traffic

    spec = registry.spec("drrho")
    assert DRRhoLoss.reads_reference and spec.table_columns({"kind": "drrho"}) == 2
    cfg = build(
        LossConfig,
        {"kind": "drrho", "learn_tau": False, "fastclip": {"gamma_rule": "drrho", "gamma_decay_epochs": 30}},
    )
    assert cfg.name == "drrho" and not cfg.learns_logit_scale
    assert make_drrho(gamma_rule="drrho", gamma_decay_epochs=30).gamma_final == pytest.approx(
        4.177 * 30**-0.7265
    )
    table = step_traffic("fastclip", 4, 8, 512, 100, feature_bytes=2, objective="drrho", ref_dim=256)
    assert table[("all_gather", "features")] == (1, 2 * 8 * (512 + 256) * 2)  # widened rows, bf16
    assert table[("all_gather", "scalars")] == (1, 8 * 5 * 8)


TRITON_SCRIPT = """
import torch, sys
sys.path.insert(0, {tests!r})
from test_drrho import make_drrho, make_pairs
gen = torch.Generator().manual_seed(2)
x, y, xr, yr = make_pairs(gen, 19)
out = []
for backend in ("naive", "triton"):
    loss = make_drrho(backend=backend, data_size=19)
    xs, ys = x.float().requires_grad_(), y.float().requires_grad_()
    p = torch.tensor(2.5, requires_grad=True)
    value = loss(xs, ys, p.exp(), torch.arange(19), reference=(xr, yr))
    value.backward()
    out.append((value.detach(), xs.grad, ys.grad, p.grad))
for got, want in zip(out[1], out[0]):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
print("triton ok")
"""


def test_triton_backend_under_interpreter():
    """The Triton kernels on the widened rows (width D + D_REF = 8, padded to the kernel's block) equal the
    full matrix; run in a fresh interpreter because TRITON_INTERPRET must be set before triton is imported."""
    pytest.importorskip("triton")
    tests = str(Path(__file__).resolve().parent)
    root = Path(__file__).resolve().parents[3]
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join(
            [str(root), str(root / "tests" / "train"), os.environ.get("PYTHONPATH", "")]
        ),
    )
    run = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT.format(tests=tests)],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and "triton ok" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]


class _WithReference(torch.nn.Module):
    """Passes the batch's reference rows as the trainer does for a ``reads_reference`` objective (base.py), so
    the trainer's own gradient-cache code (``step.forward_backward``) runs unchanged around the loss."""

    reads_reference = False  # it hands the rows to the loss itself; the trainer's step passes none

    def __init__(self, loss: DRRhoLoss, reference: tuple[torch.Tensor, torch.Tensor]):
        super().__init__()
        self.loss, self.reference = loss, reference

    def forward(self, x, y, logit_scale, index, logit_bias=None):
        return self.loss(x, y, logit_scale, index, logit_bias, reference=self.reference)


@pytest.mark.parametrize("micro", [3, 1])
def test_gradient_cache_gives_the_full_batch_gradient(micro):
    """A small open_clip model through ``forward_backward``: micro-batches (3, 3, 3, 1 and ten of 1) give the
    parameter gradients of the plain step (tests/train/gradcache_jobs.py's model and batch)."""
    import contextlib

    from gradcache_jobs import GLOBAL_BATCH, _batch, _model, _seed

    from toolkit.train.step import StepInputs, forward_backward

    gen = torch.Generator().manual_seed(4)
    ref = (
        normalize(torch.randn(GLOBAL_BATCH, 6, generator=gen), dim=1),
        normalize(torch.randn(GLOBAL_BATCH, 6, generator=gen), dim=1),
    )
    out = []
    for m in (micro, 0):
        model = _model(dropout=False)
        loss = _WithReference(make_drrho(data_size=40), ref)
        images, tokens, index = _batch()
        forward_backward(
            model,
            loss,
            StepInputs(images, tokens, index),
            micro_batch_size=m,
            seed_of=_seed(0),
            autocast=contextlib.nullcontext,
        )
        out.append({n: p.grad.clone() for n, p in model.clip.named_parameters() if p.grad is not None})
    got, want = out
    assert got.keys() == want.keys() and "logit_scale" in want
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_bf16_features_and_reference_stay_bf16_and_close_to_float64():
    """Under AMP the widened rows stay in the features' dtype when the reference comes in it (the fast path);
    the result is the float64 one to bf16 precision, and the gradients come back in bf16."""
    gen = torch.Generator().manual_seed(9)
    x, y, xr, yr = make_pairs(gen, 12)
    out = []
    for dtype in (torch.bfloat16, torch.float64):
        loss = make_drrho(data_size=12)
        xs, ys = x.to(dtype).requires_grad_(), y.to(dtype).requires_grad_()
        value = loss(xs, ys, torch.tensor(14.0), torch.arange(12), reference=(xr.to(dtype), yr.to(dtype)))
        value.backward()
        out.append((value.detach().double(), xs.grad, ys.grad))
    (v16, dx16, dy16), (v64, dx64, dy64) = out
    assert dx16.dtype == torch.bfloat16 and dy16.dtype == torch.bfloat16
    torch.testing.assert_close(v16, v64, rtol=2e-2, atol=0)
    for got, want in ((dx16, dx64), (dy16, dy64)):
        assert (got.double() - want).norm() <= 5e-2 * want.norm()


def test_toolkit_plan_tables_drrho_traffic():
    """``toolkit plan --loss drrho`` (a real CLI process) tables its traffic row: the widened feature
    gather."""
    from trainkit import run_cli

    res = run_cli(
        [
            "plan",
            "--model",
            "cliptk-tiny",
            "-b",
            "256",
            "--nproc-per-node",
            "2",
            "--device",
            "cpu",
            "--loss",
            "drrho",
        ]
    )
    assert res.returncode == 0, res.stderr
    (row,) = [line for line in res.stdout.splitlines() if line.startswith("drrho/fastclip")]
    (base,) = [line for line in res.stdout.splitlines() if line.startswith("openclip/fastclip")]
    # cliptk-tiny: embed dim 128; b = 128 per rank; d_ref taken equal to d: twice openclip's feature bytes
    assert row.split()[1:3] == ["256.00", "KiB"] and base.split()[1:3] == ["128.00", "KiB"], (row, base)
