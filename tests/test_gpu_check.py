"""python -m benchmarks.gpu.check --dry-run: every section of the GPU check runs at tiny sizes on the CPU
(Triton under TRITON_INTERPRET=1, gloo for the collectives), so the script is known to work before a GPU is
lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SECTIONS = [
    "environment",
    "kernels",
    "trainer",
    "open_clip_train",
    "jpeg decoding",
    "collectives",
    "token budgets",
    "fsdp",
]


@pytest.mark.timeout(1500)
def test_dry_run_runs_every_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env.pop("PYTHONPATH", None)  # the one command from a fresh checkout: `-m` from the repository root
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself for --dry-run
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu.check",
            "--dry-run",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=1400,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    sections = {s["name"]: s for s in report["sections"]}
    assert [s["name"] for s in report["sections"]] == SECTIONS
    assert all(s["error"] is None for s in report["sections"])
    assert "== kernels" in proc.stdout and "== trainer" in proc.stdout  # the printed table

    kernels = sections["kernels"]["rows"]
    ran = [r for r in kernels if r["status"] == "ok"]
    assert {(r["loss"], r["method"]) for r in ran} >= {
        (k, m) for k in ("clip", "sigmoid") for m in ("triton", "torch", "naive")
    }
    for r in ran:  # against the float64 oracle: fp32 to fp32 rounding, bf16 inputs to bf16 accumulation
        tol = 1e-5 if r["dtype"] == "fp32" else 3e-2
        assert r["grad_rel_err"] < tol and r["fwd_ms"] > 0, r

    trainer = sections["trainer"]["rows"]
    assert len(trainer) == 2 and all(r["status"] == "ok" and r["samples_per_s"] > 0 for r in trainer), trainer
    assert all(r["plan_gib"] and r["plan_gib"] > 0 for r in trainer), trainer
    open_clip = sections["open_clip_train"]["rows"]
    assert open_clip and all(r["status"] == "ok" and r["samples_per_s"] > 0 for r in open_clip), open_clip
    decoders = {r["decoder"] for r in sections["jpeg decoding"]["rows"]}
    assert {"torchvision decode_jpeg (libjpeg-turbo)", "PIL Image.open + convert RGB"} <= decoders
    ops = {(r["op"], r["backend"]) for r in sections["collectives"]["rows"]}
    assert ops == {("all_gather", "gloo"), ("all_reduce", "gloo")}
    tokens = sections["token budgets"]["rows"]
    assert [r["setting"] for r in tokens] == ["full", "dropout 0.5", "dropout 0.75", "half resolution"], (
        tokens
    )
    assert all(r["status"] == "ok" and r["samples_per_s"] > 0 for r in tokens), tokens
    assert tokens[3]["image_px"] == 16 and tokens[1]["step_tflop"] < tokens[0]["step_tflop"]
    fsdp = {r["case"]: r for r in sections["fsdp"]["rows"]}
    assert all(r["status"] == "ok" and r["step_ms"] > 0 for r in fsdp.values()), fsdp
    unwrapped, sharded = fsdp["unwrapped (DDP's per-rank model)"], fsdp["fsdp"]
    assert sharded["state_mib_cpu"] == pytest.approx(
        unwrapped["state_mib_cpu"], rel=1e-3
    )  # a mesh of one: whole
