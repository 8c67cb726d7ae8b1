"""A training shard that is not a regular file (a FIFO) blocked `train` and `data verify` forever (issue
34, class 5): both must end at once with one line naming the shard. Real `toolkit` processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _toolkit(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "toolkit", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture()
def fifo_train(small_train, tmp_path) -> tuple[Path, Path]:
    data = tmp_path / "train"
    shutil.copytree(small_train[0], data)
    shard = sorted(data.glob("*.tar"))[1]
    shard.unlink()
    os.mkfifo(shard)
    return data, shard


@pytest.mark.timeout(300)
def test_verify_names_a_fifo_shard_instead_of_hanging(fifo_train):
    data, shard = fifo_train
    proc = _toolkit("data", "verify", str(data))
    assert proc.returncode != 0
    assert f"{shard} is a FIFO, not a regular file" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.timeout(300)
def test_train_names_a_fifo_shard_instead_of_hanging(fifo_train, tmp_path):
    data, shard = fifo_train
    proc = _toolkit(
        "train",
        "--data",
        str(data),
        "--out",
        str(tmp_path / "run"),
        "--batch-size",
        "16",
        "--steps",
        "8",
        "--workers",
        "0",
        "--set",
        "tensorboard=false",
    )
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{shard} is a FIFO" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
