"""``--fsdp`` (train/fsdp.py): FSDP2-sharded training equals one process, and composes with the trainer's
parts.

The oracle is the issue's: K = 2 and 4 gloo ranks with --fsdp train the same weights as one plain process on
the same global batches (SGD, whole-vector relative difference <= 1e-6 after 4 steps), with and without the
gradient cache, in the fastclip and ring modes. The per-tensor worst case is larger (1.6e-6 on a LayerNorm
bias of norm ~1e-2) and is the same for DDP at K = 2 (measured: FSDP and DDP weights at K = 2 agree bit for
bit), so the whole vector is the measure, as in test_elastic.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import run_rank_script
from trainkit import metrics, train_cfg, weights

from toolkit.train.run import run

SGD = {"optim": {"name": "sgd", "lr": 0.1}}  # linear in the gradient: summation-order noise stays small
MODES = {
    "fastclip": {"kind": "fastclip", "fastclip": {"version": "v3"}, "mode": "fastclip"},
    "ring": {"kind": "openclip", "mode": "ring"},
}


def rel(got: dict, want: dict) -> float:
    """Relative L2 difference of the whole parameter vectors (module docstring)."""
    assert got.keys() == want.keys()
    num = sum(((got[k] - want[k]).double() ** 2).sum() for k in want) ** 0.5
    return float(num / sum((want[k].double() ** 2).sum() for k in want) ** 0.5)


@pytest.fixture(scope="module")
def references(demo_train, tmp_path_factory) -> dict:
    """One plain process per (mode, micro-batch): the runs every sharded job must equal."""
    base, out = tmp_path_factory.mktemp("fsdp_ref"), {}
    for mode, loss in MODES.items():
        for micro in (0, 2):
            run(
                train_cfg(
                    demo_train, base / f"{mode}-{micro}", steps=4, loss=loss, micro_batch_size=micro, **SGD
                )
            )
            out[mode, micro] = base / f"{mode}-{micro}"
    return out


def sharded_runs(data, base, world: int, runs: dict) -> dict:
    """Train ``runs`` ({name: overrides}) with --fsdp in one ``world``-rank gloo job (fsdp_jobs.py); returns
    {name: run folder}."""
    import json

    base.mkdir(parents=True, exist_ok=True)
    runs = {name: {**over, "fsdp": True} for name, over in runs.items()}
    (base / "jobs.json").write_text(json.dumps({"data": str(data), "runs": runs}))
    run_rank_script(str(Path(__file__).with_name("fsdp_jobs.py")), world, base, timeout_s=600)
    return {name: base / name for name in runs}


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_at_2_and_4_ranks_trains_the_weights_of_one_process(demo_train, references, tmp_path, world):
    runs = {
        f"{mode}-{micro}": {"steps": 4, "loss": loss, "micro_batch_size": micro, **SGD}
        for mode, loss in MODES.items()
        for micro in (0, 2)
    }  # 2: the gradient cache
    got = sharded_runs(demo_train, tmp_path, world, runs)
    for (mode, micro), want in references.items():
        out = got[f"{mode}-{micro}"]
        assert rel(weights(out), weights(want)) <= 1e-6, (mode, world, micro)
        assert [m["loss"] for m in metrics(out)] == pytest.approx(
            [m["loss"] for m in metrics(want)], rel=1e-5
        )
        sharded = out / "checkpoints" / "step-00000004"
        assert sorted(p.name for p in sharded.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(world)]


COMPOSED = {
    "gather": {"loss": {"kind": "openclip", "mode": "gather"}},
    "disco": {"loss": {"kind": "openclip", "mode": "disco"}, "micro_batch_size": 2},
    "parts": {
        "grad_checkpointing": True,
        "lock_image": True,
        "lock_image_unlocked_groups": 2,
        "ema_decay": 0.5,
        "micro_batch_size": 2,
    },
    # ZeRO-2: every unit stays gathered from its forward to its backward, with the cache's two passes
    "zero2": {"fsdp_reshard_after_forward": False, "micro_batch_size": 2},
}


@pytest.mark.dist
def test_fsdp_composes_with_the_other_modes_checkpointing_locked_towers_and_ema(demo_train, tmp_path):
    runs = {name: {"steps": 3, **over, **SGD} for name, over in COMPOSED.items()}
    got = sharded_runs(demo_train, tmp_path / "two", 2, runs)
    for name, over in runs.items():
        want = tmp_path / f"one-{name}"
        run(train_cfg(demo_train, want, **{k: v for k, v in over.items() if not k.startswith("fsdp")}))
        assert rel(weights(got[name]), weights(want)) <= 1e-6, name
    assert rel(weights(got["parts"], "model-ema"), weights(tmp_path / "one-parts", "model-ema")) <= 1e-6
    import torch

    from toolkit.models.factory import build_model, resolve_spec

    torch.manual_seed(0)  # the trainer's init (seed 0): a locked block ends where it started
    start = build_model(resolve_spec("cliptk-tiny").model_cfg).state_dict()
    frozen = "visual.transformer.resblocks.0.attn.in_proj_weight"
    assert (weights(got["parts"])[frozen] == start[frozen]).all()
    moved = "visual.proj"
    assert not (weights(got["parts"])[moved] == start[moved]).all()


@pytest.mark.parametrize(
    ("over", "words"),
    [
        ({"fsdp_cpu_offload": True}, "set fsdp too"),
        ({"fsdp_reshard_after_forward": False}, "set fsdp too"),
        ({"fsdp": True, "grad_dtype": "bf16"}, "grad_dtype sets DDP's all_reduce"),
        ({"fsdp": True, "checkpoint": {"dir": "s3://bucket/ckpt"}}, "a folder all ranks share"),
    ],
)
def test_combinations_that_cannot_work_are_refused_in_one_line(demo_train, tmp_path, over, words):
    with pytest.raises(ValueError, match=words) as err:
        train_cfg(demo_train, tmp_path, **over)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module")
def two_rank_job(demo_train, tmp_path_factory) -> dict:
    """One 2-rank sharded job of two runs: "run", 4 steps of SGD with momentum (an optimiser state to
    reshard), a checkpoint every 2; "whole", the uninterrupted run of the kill-and-resume test below
    (_cli_args' training: 8 steps of FastCLIP-v3 at batch 16, SGD at lr 0.1), trained here rather than by
    a launch of its own."""
    base = tmp_path_factory.mktemp("fsdp_two")
    over = {
        "steps": 4,
        "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "checkpoint": {"every_steps": 2},
    }
    whole = {"steps": 8, **SGD, "checkpoint": {"every_steps": 2}}
    return sharded_runs(demo_train, base, 2, {"run": over, "whole": whole})


@pytest.fixture(scope="module")
def two_rank_run(two_rank_job) -> Path:
    return two_rank_job["run"]


def _resumed(step2: Path) -> dict:
    return {
        "steps": 4,
        "optim": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        "checkpoint": {"every_steps": 2, "resume": str(step2)},
    }


@pytest.mark.dist
def test_a_sharded_checkpoint_resumes_at_4_ranks_and_at_1_with_or_without_fsdp(
    demo_train, two_rank_run, tmp_path
):
    step2, want = two_rank_run / "checkpoints" / "step-00000002", weights(two_rank_run)
    four = sharded_runs(demo_train, tmp_path / "four", 4, {"run": _resumed(step2)})["run"]
    assert rel(weights(four), want) <= 1e-6
    for fsdp in (True, False):  # one process: sharded (a group of one) or plain, loading the shards whole
        out = tmp_path / f"one-{fsdp}"
        run(train_cfg(demo_train, out, fsdp=fsdp, **_resumed(step2)))
        assert rel(weights(out), want) <= 1e-6, fsdp
        assert [m["loss"] for m in metrics(out)] == pytest.approx(
            [m["loss"] for m in metrics(two_rank_run)][2:], rel=1e-5
        )


@pytest.mark.dist
def test_a_damaged_shard_is_refused_by_name(demo_train, two_rank_run, tmp_path):
    import shutil

    from toolkit.train.checkpoint.format import CheckpointInvalid

    step2 = tmp_path / "step-00000002"
    shutil.copytree(two_rank_run / "checkpoints" / "step-00000002", step2)
    shard = step2 / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointInvalid, match=r"__1_0\.distcp: checksum does not match the manifest"):
        run(train_cfg(demo_train, tmp_path / "resumed", fsdp=True, **_resumed(step2)))


@pytest.mark.dist
def test_export_writes_the_gathered_model_of_a_sharded_run(demo_train, two_rank_run, tmp_path):
    from open_clip.factory import create_model_and_transforms

    from toolkit.core.config import build
    from toolkit.train.checkpoint.sharded import consolidate
    from toolkit.train.export import ExportConfig
    from toolkit.train.export import run as export

    whole, _, _ = consolidate(str(two_rank_run / "checkpoints" / "step-00000004"))
    state = {k: v for k, v in whole.state_dict().items() if k in weights(two_rank_run)}
    assert (
        rel(state, weights(two_rank_run)) == 0.0
    )  # the final model is the last checkpoint's shards, gathered
    out = tmp_path / "run"
    run(train_cfg(demo_train, out, steps=2, fsdp=True, **SGD))
    export(build(ExportConfig, {"run": str(out), "out": str(tmp_path / "shared")}))
    model, _, _ = create_model_and_transforms(f"local-dir:{tmp_path / 'shared'}")
    final, _, _ = consolidate(str(out / "checkpoints" / "step-00000002"))
    got, want = model.state_dict(), final.state_dict()
    assert all((got[k] == want[k]).all() for k in want)


def _cli_args(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--data",
        str(data),
        "--out",
        str(out),
        "--steps",
        "8",
        "--batch-size",
        "16",
        "--loss",
        "fastclip-v3",
        "--workers",
        "0",
        "--log-every",
        "1",
        "--checkpoint-every",
        "2",
        "--fsdp",
        "--lr",
        "0.1",
        "--set",
        "optim.name=sgd",
        "--set",
        "tensorboard=false",
        *extra,
    ]


@pytest.mark.dist
@pytest.mark.parametrize(
    "world", [1, pytest.param(4, marks=pytest.mark.slow)]
)  # 4: 3.5 min on 2 loaded cores
def test_a_killed_rank_then_a_resume_at_another_world_size_ends_as_if_uninterrupted(
    demo_train, two_rank_job, tmp_path, world
):
    """SIGKILL one of 2 sharded ranks after a checkpoint (the job fails), then the same command at ``world``
    ranks resumes from the newest complete checkpoint: the final weights of an uninterrupted 2-rank run of the
    same training (two_rank_job's "whole")."""
    import os
    import signal
    import subprocess
    import time

    from test_elastic import _children
    from trainkit import ROOT, env, run_cli, toolkit_cmd

    whole = two_rank_job["whole"]
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        toolkit_cmd(*_cli_args(demo_train, out), "--nproc-per-node", "2"),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not (out / "checkpoints" / "step-00000004" / "checkpoint.json").is_file():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint at step 4"
            time.sleep(0.05)
        workers = [w for agent in _children(proc.pid) for w in _children(agent)]
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, output[-3000:]
    extra = ["--nproc-per-node", str(world)] if world > 1 else []
    result = run_cli([*_cli_args(demo_train, out), *extra], timeout_s=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr + result.stdout
    assert rel(weights(out), weights(whole)) <= 1e-6


def test_plan_shards_parameters_gradients_and_optimizer_state_and_auto_uses_it():
    from toolkit.core.config import build
    from toolkit.train.plan.automicro import _cpu
    from toolkit.train.plan.config import PlanConfig
    from toolkit.train.plan.planner import run as plan
    from toolkit.train.plan.report import format_plan

    base = {
        "model": "cliptk-tiny",
        "batch_size": 256,
        "nproc_per_node": 4,
        "device": "cpu",
        "micro_batch_size": 16,
    }
    ddp, fsdp = plan(build(PlanConfig, base)), plan(build(PlanConfig, {**base, "fsdp": True}))
    p, k = ddp.shape.num_params, 4
    assert fsdp.rows["parameters (shards)"] == 4 * p / k
    assert fsdp.rows["optimizer state (adamw) (shards)"] == ddp.rows["optimizer state (adamw)"] / k
    assert fsdp.rows["gathered gradients (whole: cache)"] == 4 * p  # accumulated whole, reduce-scattered once
    # the root and a block beside the prefetched next one at the activation peak; the gradient shards and the
    # token embedding's backward (it gathers no weights: the largest) only at the backward's end, after the
    # activations are freed (its row: what that adds beyond them)
    u = fsdp.shape.units
    assert fsdp.rows["gathered parameters"] == 4 * (u.root + 2 * u.block)
    assert not any(k.startswith("gradients") for k in fsdp.rows)
    beside = fsdp.rows["activations (micro-batch 16)"] + fsdp.rows["gathered parameters"]
    assert u.embedding > u.tower > 0
    end = "gradient shards, last unit's backward (beyond the activations)"
    assert fsdp.rows[end] == max(0.0, 4 * p / k + 4 * u.embedding - beside)
    # DDP's buckets beside the gradients the cache accumulates; without the cache they are the peak's one copy
    assert ddp.rows["gradients"] == ddp.rows["gradient buckets (DDP)"] == 4 * p
    whole = plan(build(PlanConfig, {**base, "micro_batch_size": 0})).rows
    assert whole["gradients (DDP buckets)"] == 4 * p and "gradients" not in whole
    assert fsdp.ddp_total == pytest.approx(ddp.total)
    assert "total with DDP" in format_plan(fsdp)
    # not resharded (ZeRO-2): every parameter gathered at the peak, no second all-gather in the backward
    zero2 = plan(build(PlanConfig, {**base, "fsdp": True, "fsdp_reshard_after_forward": False}))
    assert zero2.rows["gathered parameters"] == 4 * p
    assert zero2.rows[end] == 0.0
    sent = {name: r.traffic["fsdp (parameters)"]["params"] for name, r in (("fsdp", fsdp), ("zero2", zero2))}
    # the cache's 4 micro-batches: resharded, each unit gathered in 8 forwards (the root in 4) and in 4
    # backwards but the embedding's; not resharded, each unit once per backward
    others = p - u.root
    assert sent["fsdp"] / sent["zero2"] == pytest.approx(
        (8 * others + 4 * (others - u.embedding + u.root)) / (4 * p)
    )
    # micro-batch auto: the same budget fits a larger micro-batch when the states are sharded
    budget = (
        ddp.total - ddp.rows["activations (micro-batch 16)"] + 20 * ddp.per_sample_bytes + ddp.fixed_bytes
    )
    ddp_cfg = build(PlanConfig, {**base, "micro_batch_size": 0})
    fsdp_cfg = build(PlanConfig, {**base, "micro_batch_size": 0, "fsdp": True})
    assert _cpu(fsdp_cfg, 64, budget)[0] > _cpu(ddp_cfg, 64, budget)[0]


@pytest.mark.dist
def test_the_cache_reduce_scatters_once_per_step_and_gives_ddps_gradients(tmp_path):
    """Local batch 5 in micro-batches of 2 (3 backward passes): FSDP2 issues the reduce-scatters of one pass
    (one per unit), not three, the gradients are DDP's, and the ledger counts the all-gathers FSDP2 ran, as
    the plan predicts them (fsdp_cache_jobs.py)."""
    ranks = run_rank_script(str(Path(__file__).with_name("fsdp_cache_jobs.py")), 2, tmp_path)
    for got in ranks:
        assert got[2]["calls"] == got[0]["calls"] > 0
        for micro in (0, 2):  # the ledger's parameter all-gathers are the ones FSDP2 ran (the token
            # embedding's once per forward: its backward reads no weights); bytes up to the shards' padding
            (real_calls, real_bytes), (ledger_calls, ledger_bytes, ledger_sent), planned = got[micro][
                "gathers"
            ]
            assert ledger_calls == real_calls > 0, micro
            assert ledger_bytes == pytest.approx(real_bytes, rel=0.02), micro
            assert planned == pytest.approx(ledger_sent, rel=0.02), micro
        for micro in (0, 2):
            want = got[micro]["ddp"]
            assert got[micro]["sharded"].keys() == want.keys()
            assert rel(got[micro]["sharded"], want) <= 1e-6, micro
