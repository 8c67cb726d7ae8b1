"""A precompute killed with SIGKILL resumes: finished raw shards are reused, the output is unchanged."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from datakit import MODEL, good_samples, precompute, write_raw_shard

from toolkit.data.trainset.precompute import worker as precompute_worker

# The child runs precompute inline (one worker) and SIGKILLs itself when it starts the third raw shard:
# what `kill -9` does at that moment, at a point the test knows.
KILL_AT_THIRD_SHARD = textwrap.dedent("""
    import json, os, signal, sys
    from toolkit.core.config import build
    from toolkit.data.trainset.precompute import stage as precompute, worker as precompute_worker
    real, calls = precompute_worker.process_shard, []
    def dying(job, task, on_read):
        calls.append(task.url)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(job, task, on_read)
    precompute_worker.process_shard = dying
    cfg = build(precompute.PrecomputeConfig, {"input": sys.argv[1], "out": sys.argv[2], "model": sys.argv[3],
                                              "num_workers": 1, "samples_per_shard": 10,
                                              **json.loads(sys.argv[4])})
    precompute.run(cfg)
""")


def _digest(out: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.iterdir())
        if p.name.endswith((".tar", ".meta.jsonl")) or p.name in ("dataset.json", "skipped.jsonl")
    }


def _killed_run(raw: Path, out: Path, **overrides) -> None:
    options = {"crop_scale_min": 1.0, **overrides}  # datakit.precompute's layout, so the reruns resume
    proc = subprocess.run(
        [sys.executable, "-c", KILL_AT_THIRD_SHARD, str(raw), str(out), MODEL, json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert (
        json.loads((out / "manifest.json").read_text())["status"] == "running"
    )  # killed: no chance to record


def _progress_lines(out: Path, desc: str) -> list[str]:
    """The progress records ('DESC: done[/total] samples (rate)') in a stage's log.jsonl."""
    messages = [json.loads(x)["message"] for x in (out / "log.jsonl").read_text().splitlines()]
    return [m for m in messages if re.match(rf"{desc}: \d+(/\d+)? samples \(", m)]


def _counting(monkeypatch) -> list[str]:
    """Make precompute_worker.process_shard record the URL of every raw shard it processes."""
    real, seen = precompute_worker.process_shard, []

    def counted(job, task, on_read):
        seen.append(Path(task.url).name)
        return real(job, task, on_read)

    monkeypatch.setattr(precompute_worker, "process_shard", counted)
    return seen


def test_rerun_after_kill_reuses_finished_raw_shards(small_raw, small_train, tmp_path, monkeypatch):
    out = tmp_path / "train"
    _killed_run(small_raw, out)
    work = out / "_tmp" / "resume-precompute"
    assert len(list(work.glob("*.json"))) == 2  # the two raw shards finished before the kill
    seen = _counting(monkeypatch)
    result = precompute(small_raw, out, num_workers=1, samples_per_shard=10)
    assert seen == ["00002.tar", "00003.tar", "00004.tar"]  # only the unfinished ones are processed again
    assert result.details["throughput"]["num_resumed_raw_shards"] == 2
    assert result.details["throughput"]["num_resumed_samples"] == 30 + 17
    assert "resuming: 2 of 5 raw shards" in (out / "log.jsonl").read_text()
    assert _digest(out) == _digest(small_train[0])  # the same bytes as an uninterrupted run
    assert result.counts["num_samples"] == 103 and not (out / "_tmp").exists()  # work folder gone once done


def test_changed_raw_shard_or_option_is_processed_again(small_raw, tmp_path, monkeypatch):
    raw, out = tmp_path / "raw", tmp_path / "train"
    shutil.copytree(small_raw, raw)
    _killed_run(raw, out)
    rng = np.random.default_rng(11)
    write_raw_shard(raw / "00001.tar", good_samples(rng, "new_", 4, size=(36, 33)))  # finished, then changed
    seen = _counting(monkeypatch)
    result = precompute(raw, out, num_workers=1, samples_per_shard=10)
    assert seen == ["00001.tar", "00002.tar", "00003.tar", "00004.tar"]
    assert result.counts["num_samples"] == 103 - 17 + 4
    assert result.details["throughput"]["num_resumed_raw_shards"] == 1

    out2 = tmp_path / "train_pad"
    _killed_run(raw, out2)
    seen.clear()
    precompute(raw, out2, num_workers=1, samples_per_shard=10, resize_mode="pad")  # other pixels: no reuse
    assert len(seen) == 5


def test_failed_run_keeps_processed_shards_for_the_rerun(tmp_path, monkeypatch):
    raw, out = tmp_path / "raw", tmp_path / "train"
    raw.mkdir()
    rng = np.random.default_rng(3)
    for i in range(3):
        samples = good_samples(rng, f"k{i}_", 3)
        write_raw_shard(raw / f"{i:05d}.tar", [(k, {"jpg": f["jpg"]}) for k, f in samples])  # no captions
    with pytest.raises(ValueError, match="no valid sample in 3 raw shard"):
        precompute(raw, out, num_workers=2)
    assert len(list((out / "_tmp" / "resume-precompute").glob("*.json"))) == 3
    assert "a rerun into" in (out / "log.jsonl").read_text()
    seen = _counting(monkeypatch)
    with pytest.raises(ValueError, match="missing_caption: 9"):
        precompute(raw, out, num_workers=1)
    assert seen == []  # nothing processed twice


def test_progress_counts_samples_of_one_big_shard(tmp_path, monkeypatch):
    """One raw shard: progress moves per sample (it used to sit at 0/1 shards until the end)."""
    import toolkit.core.log as log

    monkeypatch.setattr(log, "PROGRESS_LOG_INTERVAL_S", 0.0)
    raw = tmp_path / "raw"
    raw.mkdir()
    write_raw_shard(raw / "00000.tar", good_samples(np.random.default_rng(5), "big_", 12, size=(20, 20)))
    out = tmp_path / "train"
    precompute(raw, out, num_workers=1)
    counts = _progress_lines(out, "precompute")
    assert counts[0].startswith("precompute: 1/12 samples") and counts[-1].startswith(
        "precompute: 12/12 samples"
    )


def test_pool_progress_reaches_the_total(small_raw, tmp_path, monkeypatch):
    import toolkit.core.log as log

    monkeypatch.setattr(log, "PROGRESS_LOG_INTERVAL_S", 0.0)
    out = tmp_path / "train"
    precompute(small_raw, out, num_workers=2)
    counts = _progress_lines(out, "precompute")
    assert counts and counts[-1].startswith("precompute: 103/103 samples")
