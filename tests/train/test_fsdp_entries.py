"""``--fsdp`` through the entries other than ``toolkit train``: a pipeline YAML train stage (``fsdp: true``,
two ranks) and SLURM's job script (scripts/slurm/train.sbatch, run by bash with an ``srun`` that starts its
tasks on this machine). Both must train the weights of one plain process on the same global batches (SGD,
whole-vector relative difference <= 1e-6, the oracle of test_fsdp.py) and write a checkpoint of two ranks'
shards, which only a sharded run does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _launch import free_port
from test_fsdp import rel
from trainkit import MODEL, ROOT, env, metrics, train_cfg, weights

from toolkit.train.run import run

pytestmark = pytest.mark.dist
STEPS = 2


@pytest.fixture(scope="module")
def reference(demo_train, tmp_path_factory) -> Path:
    """One plain process, 2 steps of SGD at lr 0.1 (what the CLI's ``--lr 0.1 --set optim.name=sgd`` sets)."""
    out = tmp_path_factory.mktemp("fsdp_entry_ref") / "one"
    run(train_cfg(demo_train, out, steps=STEPS, optim={"name": "sgd", "lr": 0.1}))
    return out


def _assert_sharded_run_of(out: Path, reference: Path) -> None:
    assert [m["step"] for m in metrics(out)] == list(range(1, STEPS + 1))
    assert rel(weights(out), weights(reference)) <= 1e-6
    last = out / "checkpoints" / f"step-{STEPS:08d}"
    assert sorted(p.name for p in last.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


def test_a_pipeline_train_stage_with_fsdp_trains_on_two_sharded_ranks(demo_train, reference, tmp_path):
    import yaml
    from typer.testing import CliRunner

    from toolkit.cli.main import app

    config = {
        "data": str(demo_train),
        "model": MODEL,
        "batch_size": 16,
        "steps": STEPS,
        "log_every": 1,
        "tensorboard": False,
        "loader": {"num_workers": 0},
        "loss": {"kind": "fastclip", "fastclip": {"version": "v3"}},
        "optim": {"name": "sgd", "lr": 0.1},
        "fsdp": True,
        "launch": {"nproc_per_node": 2},
    }
    pipeline = {
        "run_dir": str(tmp_path / "run"),
        "stages": [{"name": "train", "kind": "train", "config": config}],
    }
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(pipeline))
    result = CliRunner().invoke(app, ["--quiet", "pipeline", "run", str(path)])
    assert result.exit_code == 0, result.output
    _assert_sharded_run_of(tmp_path / "run" / "train", reference)
    assert yaml.safe_load((tmp_path / "run" / "train" / "config.yaml").read_text())["fsdp"] is True


# srun for one node: SLURM_NTASKS copies of the command, each with its task's variables; its exit code is the
# first failed task's (as --kill-on-bad-exit makes it). Its options (--kill-on-bad-exit=1) are dropped.
SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
echo "$@" > "$SRUN_LOG"
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do SLURM_PROCID=$i SLURM_LOCALID=$i "$@" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }; done
exit "$status"
"""
# scontrol: the job's host list (launch.py's _slurm_hosts asks it) and a requeue, recorded
SCONTROL = """#!/usr/bin/env bash
if [ "$1" = show ]; then echo 127.0.0.1; else echo "$@" >> "$SCONTROL_LOG"; fi
"""


def test_slurms_job_script_passes_fsdp_to_every_task(demo_train, reference, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {
        "srun": SRUN,
        "scontrol": SCONTROL,
        "toolkit": f'#!/bin/sh\nexec "{sys.executable}" -m toolkit "$@"\n',
    }.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    slurm = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "TOOLKIT": str(bin_dir / "toolkit"),
        "SRUN_LOG": str(tmp_path / "srun.log"),
        "SCONTROL_LOG": str(tmp_path / "scontrol.log"),
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NNODES": "1",
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_CPUS_PER_TASK": "1",
        "SLURM_JOB_NODELIST": "localhost",
        "MASTER_PORT": str(free_port()),
    }
    out = tmp_path / "slurm"
    options = ["--steps", str(STEPS), "--batch-size", "16", "--loss", "fastclip-v3", "--workers", "0"]
    options += ["--log-every", "1", "--fsdp", "--lr", "0.1", "--set", "optim.name=sgd"]
    done = subprocess.run(
        [
            "bash",
            "scripts/slurm/train.sbatch",
            str(demo_train),
            str(out),
            *options,
            "--set",
            "tensorboard=false",
        ],
        cwd=ROOT,
        env={**env(), **slurm},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "cliptk: training finished" in done.stdout and not (tmp_path / "scontrol.log").exists()
    assert "--fsdp" in (tmp_path / "srun.log").read_text().split()
    _assert_sharded_run_of(out, reference)
