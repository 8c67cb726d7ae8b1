"""scripts/chaos_train.py end to end: random worker kills and a whole-job kill resumed at another world
size."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from trainkit import ROOT, env


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize(
    "loss",
    [
        [],  # FastCLIP-v3: its per-sample tables
        [
            "--loss",
            "neuclip",
            "--set",
            "loss.neuclip.num_prototypes=48",
            "--set",
            "loss.neuclip.restart_every_steps=7",
            "--set",
            "loss.neuclip.adagrad_eps=1e-4",
        ],  # why ε 1e-4: test_elastic.py, NEUCLIP
        ["--fsdp"],  # sharded steps and checkpoints, resharded to 1 process
    ],
    ids=["fastclip-v3", "neuclip", "fsdp"],
)
def test_chaos_script_finds_no_duplicates_no_skips_and_equal_weights(demo_train, tmp_path, loss):
    out = tmp_path / "chaos"
    done = subprocess.run(
        [
            sys.executable,
            "scripts/chaos_train.py",
            "--out",
            str(out),
            "--data",
            str(demo_train),
            "--kills",
            "2",
            "--steps",
            "30",
            "--seed",
            "1",
            *loss,
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "chaos_report.json").read_text())
    assert report["kills_survived"] == 3 and report["resume_nproc"] == 1
    assert (
        report["samples_seen_twice"] == 0
        and report["samples_skipped"] == 0
        and report["batches_differing"] == 0
    )
    assert report["weights_rel_diff"] <= 1e-5 and report["tables_rel_diff"] <= 1e-5
