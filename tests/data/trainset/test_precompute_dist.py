"""Distributed precompute: 2 gloo ranks (torchrun) and 2 "nodes" (two launchers on 127.0.0.1) write the
same bytes as one process, skip accounting and damaged tars included."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from datakit import MODEL, precompute

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[3]


def _digest(out: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.iterdir())
        if p.name.endswith((".tar", ".meta.jsonl", ".sums")) or p.name in ("dataset.json", "skipped.jsonl")
    }


def _cmd(raw: Path, out: Path, *extra: str) -> list[str]:
    # crop_scale_min 1: the layout datakit.precompute writes, so both sides run the same config; the bad_raw
    # fixture's shards are truncated on purpose (max_truncated_share 1 keeps what is left, as datakit does)
    return [
        sys.executable,
        "-m",
        "toolkit",
        "data",
        "precompute",
        "--in",
        str(raw),
        "--out",
        str(out),
        "--model",
        MODEL,
        "--samples-per-shard",
        "7",
        "--workers",
        "1",
        "--set",
        "crop_scale_min=1.0",
        "--set",
        "max_truncated_share=1",
        *extra,
    ]


def _env() -> dict[str, str]:
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_process(bad_raw, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    precompute(bad_raw[0], out, num_workers=1, samples_per_shard=7, max_truncated_share=1)
    return out


def test_two_ranks_write_the_same_bytes_as_one_process(bad_raw, one_process, tmp_path):
    out = tmp_path / "two"
    proc = subprocess.run(
        _cmd(bad_raw[0], out, "--nproc-per-node", "2"),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _digest(out) == _digest(one_process) and len(_digest(out)) > 4
    manifest = json.loads((out / "manifest.json").read_text())
    want = json.loads((one_process / "manifest.json").read_text())
    from toolkit.core.config import build, config_hash
    from toolkit.data.trainset.precompute.stage import KIND, PrecomputeConfig

    single = build(
        PrecomputeConfig,
        {
            "input": str(bad_raw[0]),
            "out": str(out),
            "model": MODEL,
            "samples_per_shard": 7,
            "crop_scale_min": 1.0,
            "max_truncated_share": 1.0,
        },
    )
    assert manifest["status"] == "done" and manifest["config_hash"] == config_hash(
        single, KIND
    )  # launch: no part
    assert {k: v for k, v in manifest["counts"].items() if k != "samples_per_s"} == {
        k: v for k, v in want["counts"].items() if k != "samples_per_s"
    }
    assert manifest["counts"]["skipped"]["duplicate_key"] >= 1  # ids were assigned over both ranks' shards
    assert f"{manifest['counts']['num_samples']} samples in" in proc.stdout
    assert not (out / "_tmp").exists()


def test_two_launchers_as_two_nodes_write_the_same_bytes(bad_raw, one_process, tmp_path):
    out, port = tmp_path / "nodes", str(_free_port())
    procs = [
        subprocess.Popen(
            _cmd(
                bad_raw[0],
                out,
                "--nodes",
                "2",
                "--node-rank",
                str(r),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
            ),
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [log[-3000:] for log in logs]
    assert _digest(out) == _digest(one_process)
    assert "node 0 wrote the output" in logs[1]


def test_tasks_started_by_slurm_write_the_same_bytes(bad_raw, one_process, tmp_path):
    """Two tasks with SLURM's variables (what `srun --ntasks 2 toolkit data precompute ...` sets) are one
    job."""
    out, port, procs = tmp_path / "slurm", str(_free_port()), []
    for rank in (0, 1):
        slurm = {
            "SLURM_NTASKS": "2",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NNODES": "1",
            "SLURM_NODEID": "0",
            "SLURM_JOB_NODELIST": "localhost",
            "MASTER_PORT": port,
        }
        procs.append(
            subprocess.Popen(
                _cmd(bad_raw[0], out),
                cwd=ROOT,
                env={**_env(), **slurm},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [log[-3000:] for log in logs]
    assert _digest(out) == _digest(one_process)
