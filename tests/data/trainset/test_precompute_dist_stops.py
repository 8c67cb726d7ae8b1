"""Distributed precompute that stops (issue 43 item 9): a SIGKILLed rank is the one named, the manifest never
stays `running`, and SIGTERM ends the launcher with 143 in precompute's own words (no checkpoint)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from datakit import MODEL, good_samples, write_raw_shard
from proctools import descendants

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    root = tmp_path_factory.mktemp("raw_stops")
    rng = np.random.default_rng(3)
    for i in range(8):
        write_raw_shard(root / f"{i:05d}.tar", good_samples(rng, f"s{i}_", 24, size=(96, 80)))
    return root


def _start(raw: Path, out: Path) -> subprocess.Popen:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    return subprocess.Popen(
        [
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
            "--workers",
            "1",
            "--nproc-per-node",
            "2",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    """The pid of ``rank`` among this launcher's descendants (never another test's job: the suite may run
    two tests at a time)."""
    for pid in sorted(descendants(launcher.pid)):
        proc = Path(f"/proc/{pid}")
        try:
            if b"toolkit.data.trainset.precompute.rank" not in (proc / "cmdline").read_bytes():
                continue
            if f"RANK={rank}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                return int(proc.name)
        except OSError:
            continue
    return None


def _when_running(out: Path, launcher: subprocess.Popen, timeout_s: float = 240) -> None:
    """Wait until rank 0 has recorded the stage as running (and rank 1 exists)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and launcher.poll() is None:
        try:
            if json.loads((out / "manifest.json").read_text())["status"] == "running" and _rank_pid(
                launcher, 1
            ):
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    raise AssertionError(
        f"the job never ran: {launcher.communicate()[1][-3000:] if launcher.poll() is not None else ''}"
    )


def test_a_sigkilled_rank_is_named_and_the_manifest_says_failed(raw, tmp_path):
    """Before: the message blamed rank 0's SIGTERM (torchrun's, after rank 1 died); manifest.json said
    running."""
    out = tmp_path / "out"
    launcher = _start(raw, out)
    _when_running(out, launcher)
    os.kill(_rank_pid(launcher, 1), signal.SIGKILL)
    _, stderr = launcher.communicate(timeout=240)
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert launcher.returncode == 1 and len(errors) == 1, stderr[-3000:]
    assert "rank 1 exited with code -9" in errors[0], stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "rank 1" in manifest["error"]


def test_sigterm_ends_with_143_and_an_interrupted_manifest(raw, tmp_path):
    """Before: exit 1, "resume from the newest checkpoint" (the trainer's words), manifest.json said
    running."""
    out = tmp_path / "out"
    launcher = _start(raw, out)
    _when_running(out, launcher)
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=240)
    assert launcher.returncode == 143, stderr[-3000:]
    assert "interrupted by SIGTERM" in stderr and "checkpoint" not in stderr, stderr[-3000:]
    assert json.loads((out / "manifest.json").read_text())["status"] == "interrupted"
