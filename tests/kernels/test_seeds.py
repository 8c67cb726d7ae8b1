"""The kernel tests' seeds (conftest.py): fixed per test by default, set or drawn fresh through
CLIPTK_KERNEL_SEED, and reported with a replay command when a test fails. Checked by running pytest on a
small failing test that uses the real conftest, in a subprocess."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

FAILING = """
import torch


def test_draws(gen):
    print("drew", torch.randint(0, 2**30, (1,), generator=gen).item())
    assert False
"""


def _run(tmp_path: Path, seed: str | None) -> tuple[int, int]:
    """(reported seed, the value the test drew) of one pytest run of FAILING."""
    env = {k: v for k, v in os.environ.items() if k != "CLIPTK_KERNEL_SEED"}
    if seed is not None:
        env["CLIPTK_KERNEL_SEED"] = seed
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_draws.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    replay = r"seed (\d+); replay: CLIPTK_KERNEL_SEED=(\d+) python -m pytest 'test_draws.py::test_draws'"
    reported = re.search(replay, out)
    drew = re.search(r"drew (\d+)", out)
    assert reported and drew and reported[1] == reported[2], out[-3000:]
    return int(reported[1]), int(drew[1])


def test_seed_is_fixed_by_default_replayable_and_reported_on_failure(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_draws.py").write_text(FAILING)
    seed, drew = _run(tmp_path, None)
    assert seed == zlib.crc32(b"test_draws.py::test_draws") & 0x7FFFFFFF  # fixed: every CI run draws the same
    assert _run(tmp_path, str(seed)) == (seed, drew)  # the reported seed replays the same draw
    assert _run(tmp_path, "random")[0] != seed  # a fresh 31-bit draw equals it with probability 2^-31
