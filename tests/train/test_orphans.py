"""A SIGKILLed `toolkit train` launcher takes torchrun's agent and every rank with it (issue 34, class 4):
they used to train on, and an immediate rerun trained into the same run folder concurrently. Real torchrun,
--nproc-per-node 2, gloo."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from trainkit import ROOT, env, metrics, toolkit_cmd

sys.path.insert(0, str(ROOT / "tests" / "core"))
from proctools import alive, descendants, wait_for  # noqa: E402

ARGS = [
    "--batch-size",
    "16",
    "--loss",
    "fastclip-v3",
    "--workers",
    "0",
    "--log-every",
    "1",
    "--checkpoint-every",
    "4",
    "--set",
    "tensorboard=false",
]


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_sigkilled_launcher_leaves_no_rank_running(demo_train, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        toolkit_cmd(
            "train",
            "--data",
            str(demo_train),
            "--out",
            str(out),
            "--steps",
            "400",
            *ARGS,
            "--nproc-per-node",
            "2",
        ),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for(
        lambda: proc.poll() is not None or ((out / "metrics.jsonl").is_file() and len(metrics(out)) >= 2),
        300,
        "two logged steps",
    )
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    tree = descendants(proc.pid)
    assert len(tree) >= 3  # the agent and two ranks (and what they started)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    wait_for(lambda: not any(alive(p) for p in tree), 30, f"the agent and ranks {sorted(tree)} to exit")
    steps = len(metrics(out))
    time.sleep(2.0)
    assert len(metrics(out)) == steps  # nobody trains on into the folder


def _two_rank_job(data, out, *extra: str) -> tuple[subprocess.Popen, int]:
    """A 2-rank `toolkit train` past its second logged step: (the launcher, rank 1's pid)."""
    import json

    proc = subprocess.Popen(
        toolkit_cmd(
            "train",
            "--data",
            str(data),
            "--out",
            str(out),
            "--steps",
            "400",
            *ARGS,
            "--nproc-per-node",
            "2",
            *extra,
        ),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    beat = out / ".heartbeat" / "rank-1.json"
    wait_for(
        lambda: (
            proc.poll() is not None
            or (beat.is_file() and (out / "metrics.jsonl").is_file() and len(metrics(out)) >= 2)
        ),
        300,
        "two logged steps",
    )
    assert proc.poll() is None, proc.stderr.read()[-3000:]
    return proc, json.loads(beat.read_text())["pid"]


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_a_stopped_rank_is_named_by_the_watchdog(demo_train, tmp_path):
    """Issue 34 class 5: a SIGSTOPped rank went unreported for the 1,800 s collective timeout."""
    import os

    proc, rank1 = _two_rank_job(demo_train, tmp_path / "run", "--set", "watchdog_s=8")
    tree = descendants(proc.pid)
    assert rank1 in tree
    os.kill(rank1, signal.SIGSTOP)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 1, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr[-3000:]
    assert f"rank 1 (pid {rank1} " in errors[0] and "watchdog_s=8" in errors[0] and "stopped" in errors[0], (
        errors
    )
    wait_for(lambda: not any(alive(p) for p in tree), 30, "the job's processes to exit")


def test_first_failure_is_the_signalled_rank_then_the_earliest_with_its_own_message(tmp_path, monkeypatch):
    """Issue 34 class 7: the lowest failed rank was blamed, with torch's "To enable traceback see" line."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from toolkit.core.agent import first_failure, write_error_file

    def failure(rank: int, exitcode: int, message: str | None) -> ProcessFailure:
        path = tmp_path / f"error-{rank}.json"
        if message is not None:
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
            write_error_file(message)
        return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))

    later = failure(0, 1, "RuntimeError: Connection closed by peer")
    killed = failure(1, -9, None)
    text = first_failure(ChildFailedError("train", {0: later, 1: killed}))
    assert text.startswith("rank 1 exited with code -9 (Signal 9 (SIGKILL)"), text
    # the race a loaded machine shows: rank 0 records its collective's error, then the agent SIGTERMs it
    consequence = failure(0, -15, "RuntimeError: Connection closed by peer")
    killed = failure(1, -9, None)
    killed.timestamp = int(time.time()) + 1  # the agent records a SIGKILL when it notices it, later
    text = first_failure(ChildFailedError("train", {0: consequence, 1: killed}))
    assert text.startswith("rank 1 exited with code -9 (Signal 9 (SIGKILL)"), text
    first = failure(1, 1, "ValueError: the root cause")
    time.sleep(0.01)
    second = failure(0, 1, "RuntimeError: a consequence")
    text = first_failure(ChildFailedError("train", {0: second, 1: first}))
    assert text == "rank 1 exited with code 1 (ValueError: the root cause)", text


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_a_killed_rank_is_blamed_not_rank_0(demo_train, tmp_path):
    import os

    proc, rank1 = _two_rank_job(demo_train, tmp_path / "run")
    os.kill(rank1, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 1, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "training workers failed: rank 1 exited with code -9" in errors[0], errors
