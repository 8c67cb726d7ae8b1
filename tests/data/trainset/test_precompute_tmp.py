"""precompute removes the scratch folders (`_tmp/precompute-*`) that a killed run left behind."""

from __future__ import annotations

import socket
import subprocess
import sys

from datakit import precompute


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # exited and reaped: nobody runs under it (barring pid reuse within the test)


def test_stale_scratch_in_out_tmp_is_removed(small_raw, tmp_path):
    out = tmp_path / "train"
    host = socket.gethostname()
    stale = [out / "_tmp" / "precompute-ab12cd", out / "_tmp" / f"precompute-{host}-{_dead_pid()}-x1y2"]
    for folder in stale:
        folder.mkdir(parents=True)
        (folder / "000000.image").write_bytes(b"\0" * 4096)  # what kill -9 leaves: scratch rows
    (out / "_tmp" / "unrelated").mkdir()
    result = precompute(small_raw, out, num_workers=1, samples_per_shard=50)
    assert result.counts["num_samples"] == 103
    assert sorted(p.name for p in (out / "_tmp").iterdir()) == ["unrelated"]  # ours gone, others' kept
    log = (out / "log.jsonl").read_text()
    assert all(f"removed {p.name} left by a run that was killed" in log for p in stale)


def test_shared_tmp_dir_keeps_folders_of_running_or_unknown_owners(small_raw, tmp_path):
    shared = tmp_path / "scratch"
    host = socket.gethostname()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        names = {
            "dead": f"precompute-{host}-{_dead_pid()}-aa",
            "running": f"precompute-{host}-{sleeper.pid}-bb",
            "other_host": "precompute-some-other-host-1-cc",
            "unknown": "precompute-legacy9",
        }
        for name in names.values():
            (shared / name).mkdir(parents=True)
        precompute(small_raw, tmp_path / "train", num_workers=1, tmp_dir=str(shared))
        left = {p.name for p in shared.iterdir()}
    finally:
        sleeper.kill()
        sleeper.wait()
    assert left == {names["running"], names["other_host"], names["unknown"]}
