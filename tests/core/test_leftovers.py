"""A killed run's temp files stay in OUT for good (issue 34, class 13): the next run of the stage removes
those whose writer is gone, and says so; a temp whose writer still runs is left alone."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from proctools import env


def test_rerun_removes_a_killed_runs_temps_and_says_so(tmp_path):
    from datakit import good_samples, write_raw_shard

    raw, out = tmp_path / "raw", tmp_path / "out"
    raw.mkdir()
    write_raw_shard(raw / "00000.tar", good_samples(np.random.default_rng(0), "k", 4))
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)  # a writer that has exited
    live = subprocess.Popen(["sleep", "120"])
    (out / "checkpoints" / f".step-00000008.tmp-{pid}-0123abcd").mkdir(parents=True)
    (out / "checkpoints" / f".step-00000008.tmp-{pid}-0123abcd" / "open_clip_model.safetensors").write_bytes(
        b"x"
    )
    dead_files = [f"00000.tar.tmp-{pid}", f".dataset.json.{pid}-89abcdef", f".manifest.json.{pid}-00aa11bb"]
    for name in dead_files:
        (out / name).write_bytes(b"partial")
    (out / f".dataset.json.{live.pid}-89abcdef").write_bytes(b"being written")
    (out / "notes.tmp-draft").write_bytes(b"a user's file")
    try:
        proc = subprocess.run(
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
                "cliptk-tiny",
                "--workers",
                "1",
            ],
            env=env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        assert not any((out / name).exists() for name in dead_files)
        assert not (out / "checkpoints" / f".step-00000008.tmp-{pid}-0123abcd").exists()
        assert (out / f".dataset.json.{live.pid}-89abcdef").exists() and (out / "notes.tmp-draft").exists()
        assert "removed 4 temp file(s) a killed run left in" in proc.stderr, proc.stderr
        assert f"checkpoints/.step-00000008.tmp-{pid}-0123abcd" in proc.stderr
    finally:
        live.kill()
        live.wait()
