"""toolkit.train.hostmem: when the trainer changes glibc's malloc settings, and when it leaves them alone."""

from __future__ import annotations

import subprocess
import sys

import pytest
from trainkit import env

from toolkit.train import hostmem


def test_leaves_cuda_and_a_users_setting_alone(monkeypatch):
    assert not hostmem.release_freed_memory("cuda")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "1048576")
    assert not hostmem.release_freed_memory("cpu")


@pytest.mark.skipif(hostmem._glibc() is None, reason="needs Linux glibc")
def test_sets_the_threshold_on_the_cpu_under_glibc():
    code = "from toolkit.train.hostmem import release_freed_memory as r; print(r('cpu'))"
    child_env = {k: v for k, v in env().items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=child_env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
