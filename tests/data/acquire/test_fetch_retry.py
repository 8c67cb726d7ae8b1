"""`toolkit data fetch --retry-failed` against a real HTTP server on 127.0.0.1 whose flaky URLs fail their
first attempts (503, a stall past the timeout, a dropped connection) and then serve the image.

Four img2dataset runs (seconds each): a fetch, a retry round, a resumed round after a simulated kill, and
a retry with nothing left to retry that changes nothing. Permanent failures (404, not an image) are never
requested again.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from datakit import read_tar
from PIL import Image

from toolkit.data.acquire.fetch import run
from toolkit.data.acquire.fetch_config import FetchConfig
from toolkit.data.acquire.retry import is_transient
from toolkit.data.acquire.serve import QuietHandler, serve

TIMEOUT_S = 1.0
STALL_S = 2.5  # a stalled first attempt answers nothing for this long (past the timeout), then hangs up
PER_SHARD = 2


class FlakyHandler(QuietHandler):
    """/FAULT-N/NAME fails its first N requests with FAULT (503, stall or drop), then serves NAME."""

    def send_head(self):
        first = self.path.strip("/").split("/", 1)[0]
        if "-" not in first:
            return super().send_head()
        fault, times = first.rsplit("-", 1)
        with self.server.count_lock:
            self.server.request_counts[self.path] += 1
            attempt = self.server.request_counts[self.path]
        if attempt <= int(times):
            if fault == "e503":
                self.send_error(503)
            elif fault == "stall":
                time.sleep(STALL_S)
            self.close_connection = True  # 'drop' (and a stall) hang up without an answer
            return None
        self.path = "/" + self.path.strip("/").split("/", 1)[1]
        return super().send_head()


# (path, caption, reason after the first fetch, attempts until it succeeds); shards of 2 in list order
ROWS = [
    ("good0.jpg", "good zero", "success", 1),
    ("good1.jpg", "good one", "success", 1),
    ("e503-1/a.jpg", "flaky a", "http_503", 2),
    ("missing.jpg", "gone", "http_404", None),
    ("good2.jpg", "good two", "success", 1),
    ("stall-1/b.jpg", "flaky b", "timeout", 2),
    ("drop-1/c.jpg", "flaky c", "connection_error", 2),
    ("page.jpg", "html", "not_an_image", None),
    ("e503-2/d.jpg", "flaky d", "http_503", 3),
    ("good3.jpg", "good three", "success", 1),
]


@pytest.fixture()
def flaky_site(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    rng = np.random.default_rng()
    for name in ("good0", "good1", "good2", "good3", "a", "b", "c", "d"):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)).save(buf, "JPEG")
        (root / f"{name}.jpg").write_bytes(buf.getvalue())
    (root / "page.jpg").write_bytes(b"<html>not an image</html>")
    with serve(str(root), handler_cls=FlakyHandler) as server:
        urls = tmp_path / "urls.csv"
        urls.write_text("url,caption\n" + "".join(f"{server.url}{p},{c}\n" for p, c, _, _ in ROWS))
        yield server, urls, tmp_path / "raw"


def _cli(urls: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "toolkit",
            "data",
            "fetch",
            "--urls",
            str(urls),
            "--out",
            str(out),
            "--image-size",
            "16",
            "--samples-per-shard",
            str(PER_SHARD),
            "--timeout",
            str(TIMEOUT_S),
            "--threads",
            "4",
            *extra,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def _snapshot(out: Path) -> dict[str, str]:
    return {
        p.relative_to(out).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name not in ("manifest.json", "log.jsonl", "config.yaml")
    }  # run records


def _captions(out: Path) -> list[str]:
    return sorted(f["txt"].decode() for tar in out.glob("*.tar") for f in read_tar(tar).values())


def test_transient_reasons():
    assert all(
        is_transient(r)
        for r in (
            "timeout",
            "http_503",
            "http_500",
            "http_429",
            "connection_error",
            "connection_refused",
            "incomplete_transfer",
        )
    )
    assert not any(
        is_transient(r)
        for r in (
            "http_404",
            "http_403",
            "not_an_image",
            "decode_error",
            "truncated_image",
            "too_large",
            "dns_error",
            "disallowed_scheme",
        )
    )


def test_retry_failed_refetches_only_transient_failures_into_new_shards(flaky_site):
    server, urls, out = flaky_site
    cfg = FetchConfig(
        urls=str(urls),
        out=str(out),
        image_size=16,
        samples_per_shard=PER_SHARD,
        timeout_s=TIMEOUT_S,
        num_threads=4,
    )
    first = run(cfg).counts
    assert first["failed_by_reason"] == {
        "http_503": 2,
        "connection_error": 1,
        "http_404": 1,
        "not_an_image": 1,
        "timeout": 1,
    }
    original = _snapshot(out)

    # round 1: a, b, c (into shard 00005) and d (00006, fails again: it needs three attempts)
    proc = _cli(urls, out, "--retry-failed")
    assert proc.returncode == 0, proc.stderr
    assert (
        "retry round 1: fetched again 4 URLs that failed transiently (http_503 2, connection_error 1, "
        "timeout 1) into shards 00005..00006: 3 ok now; failed URLs 6 -> 3 (not retried, permanent: "
        "http_404 1, not_an_image 1)"
    ) in proc.stdout, proc.stdout
    assert "10 URLs: 7 ok, 3 failed (http_404 1, http_503 1, not_an_image 1); 7 shards" in proc.stdout
    after = _snapshot(out)
    assert {k: v for k, v in after.items() if k in original} == original  # finished shards never rewritten
    assert {k for k in after if k not in original} >= {"00005.tar", "00006.tar", "_retries/round-00001.json"}
    assert _captions(out) == sorted(
        ["good zero", "good one", "good two", "good three", "flaky a", "flaky b", "flaky c"]
    )

    # a kill during round 2's shard (simulated: its stats file never written) resumes round 2, not a new one
    proc = _cli(urls, out, "--retry-failed")
    assert proc.returncode == 0 and "retry round 2: fetched again 1 URLs" in proc.stdout, proc.stdout
    assert "failed URLs 3 -> 2" in proc.stdout
    (out / "00007_stats.json").unlink()
    counts_before = dict(server.request_counts)
    proc = _cli(urls, out, "--retry-failed")
    assert proc.returncode == 0, proc.stderr
    assert "retry round 2: fetched again" in proc.stdout and "shards 00007..00007" in proc.stdout
    assert "10 URLs: 8 ok, 2 failed (http_404 1, not_an_image 1); 8 shards (7 resumed)" in proc.stdout
    assert server.request_counts["/e503-2/d.jpg"] == counts_before["/e503-2/d.jpg"] + 1  # only d again
    d_paths = ("/e503-2/d.jpg", "/d.jpg")  # the flaky path, and the file it serves
    assert {p: n for p, n in server.request_counts.items() if p not in d_paths} == {
        p: n for p, n in counts_before.items() if p not in d_paths
    }

    # nothing left to retry: says so, requests nothing, changes no file
    before, requests = _snapshot(out), sum(server.request_counts.values())
    proc = _cli(urls, out, "--retry-failed")
    assert proc.returncode == 0, proc.stderr
    assert (
        "retry: nothing to retry: none of the 2 failed URLs failed for a transient reason (permanent: "
        "http_404 1, not_an_image 1); nothing was changed"
    ) in proc.stdout
    assert _snapshot(out) == before and sum(server.request_counts.values()) == requests
    assert server.request_counts["/missing.jpg"] == 1 and server.request_counts["/page.jpg"] == 1
    manifest = json.loads((out / "manifest.json").read_text())
    c = manifest["counts"]
    assert (c["num_urls"], c["num_success"], c["num_failed"], c["num_retried"]) == (10, 8, 2, 5)
    assert _captions(out) == sorted(
        ["good zero", "good one", "good two", "good three", "flaky a", "flaky b", "flaky c", "flaky d"]
    )


@pytest.mark.timeout(300)
def test_retry_failed_on_the_first_run_fetches_then_retries_in_the_same_run(flaky_site):
    """`fetch --retry-failed` into an empty folder (fetch, then one retry round in the same run) crashed with
    FileNotFoundError: OUT/_tmp/retry-urls.parquet: the first fetch's worker had removed OUT/_tmp."""
    server, urls, out = flaky_site
    short = urls.parent / "short.csv"
    short.write_text("url,caption\n" + "".join(f"{server.url}{p},{c}\n" for p, c, _, _ in ROWS[:4]))
    result = run(
        FetchConfig(
            urls=str(short),
            out=str(out),
            image_size=16,
            samples_per_shard=PER_SHARD,
            timeout_s=TIMEOUT_S,
            num_threads=4,
            retry_failed=True,
        )
    )
    c = result.counts
    assert (c["num_urls"], c["num_success"], c["failed_by_reason"], c["num_retried"]) == (
        4,
        3,
        {"http_404": 1},
        1,
    )
    assert result.details["retry"]["round"] == 1 and result.details["retry"]["round_success"] == 1
    assert server.request_counts["/e503-1/a.jpg"] == 2 and _captions(out) == [
        "flaky a",
        "good one",
        "good zero",
    ]
