"""A full disk while writing training shards gave `[Errno 28]` with no path and left the manifest "running"
(issue 34, class 11). A real full tmpfs (user and mount namespace, no root needed) under --out."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]


def _unshare_works() -> bool:
    return (
        shutil.which("unshare") is not None
        and subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0
    )


@pytest.mark.skipif(not _unshare_works(), reason="no unprivileged user+mount namespaces (unshare -rm) here")
def test_full_disk_names_the_shard_and_the_manifest_says_failed(tmp_path):
    from datakit import good_samples, write_raw_shard

    raw, out, scratch = tmp_path / "raw", tmp_path / "out", tmp_path / "scratch"
    raw.mkdir()
    out.mkdir()
    write_raw_shard(raw / "00000.tar", good_samples(np.random.default_rng(0), "k", 60, size=(64, 64)))
    cmd = (
        f"{sys.executable} -m toolkit data precompute --in {raw} --out {out} --model cliptk-tiny --workers 1 "
        f"--set tmp_dir={scratch} --samples-per-shard 1000"
    )
    script = f"mount -t tmpfs -o size=192k tmpfs {out} && {cmd}; echo rc=$?; cat {out}/manifest.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert "rc=1" in result.stdout, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "No space left on device while writing the training shard" in errors[0], errors
    assert f"{out}/00000.tar" in errors[0], errors
    manifest = json.loads(result.stdout.split("rc=1", 1)[1])
    assert manifest["status"] == "failed" and "No space left" in manifest["error"]


@pytest.mark.skipif(not _unshare_works(), reason="no unprivileged user+mount namespaces (unshare -rm) here")
def test_a_full_scratch_folder_is_blamed_not_the_raw_shard(tmp_path):
    from datakit import good_samples, write_raw_shard

    raw, out, scratch = tmp_path / "raw", tmp_path / "out", tmp_path / "scratch"
    raw.mkdir()
    scratch.mkdir()
    write_raw_shard(raw / "00000.tar", good_samples(np.random.default_rng(0), "k", 60, size=(64, 64)))
    cmd = (
        f"{sys.executable} -m toolkit data precompute --in {raw} --out {out} --model cliptk-tiny --workers 1 "
        f"--set tmp_dir={scratch}"
    )
    script = f"mount -t tmpfs -o size=128k tmpfs {scratch} && {cmd}; echo rc=$?"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert "rc=1" in result.stdout, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert (
        f"the scratch folder {scratch}" in errors[0] and "is full" in errors[0] and "tmp_dir" in errors[0]
    ), errors
