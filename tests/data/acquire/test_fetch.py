"""`toolkit data fetch` over a real HTTP server on 127.0.0.1 serving good images and every kind of bad URL.

Three img2dataset runs in all (each costs seconds of imports): a first fetch through the process pool,
a resumed fetch after a simulated crash through the CLI, and a fetch where nothing can be downloaded.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from datakit import read_tar
from PIL import Image

from toolkit.data.acquire.fetch import run
from toolkit.data.acquire.fetch_config import FetchConfig
from toolkit.data.acquire.fetch_resume import check_resumable
from toolkit.data.acquire.resizer import decode_image
from toolkit.data.acquire.serve import QuietHandler, serve
from toolkit.data.acquire.shard import PARQUET_COLUMNS
from toolkit.data.acquire.urllist import check_url_list, detect_format
from toolkit.data.raw import layout, reasons

TIMEOUT_S = 1.0
SLOW_S = 3.0  # the slow endpoint hangs up after this long: past the timeout, bounded so the server stops
IMAGE_SIZE = 24
PER_SHARD = 4
EXPECTED_FAILURES = {
    "http_404": 2,
    "http_500": 1,
    "timeout": 2,
    "truncated_image": 1,
    "corrupt_image": 1,
    "not_an_image": 1,
    "empty_response": 1,
    "connection_refused": 1,
}


class BadHandler(QuietHandler):
    """Static files plus /error (HTTP 500) and /slow (silent for SLOW_S, then hangs up)."""

    def send_head(self):
        if self.path.startswith("/error"):
            self.server.request_counts[self.path] += 1
            self.send_error(500)
            return None
        if self.path.startswith("/slow"):
            self.server.request_counts[self.path] += 1
            time.sleep(SLOW_S)  # then hang up without an answer, long after the client gave up
            return None
        return super().send_head()


def _encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def _free_port() -> int:
    """A port nothing listens on (bound, then released): connecting to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_site(root, rng) -> list[tuple[str, str, str]]:
    """Files under ``root``; rows (path or URL, caption, expected reason) in URL-list order.

    Shards of 4: 0-2 hold only good images (shard 1 is the one the resume test refetches), 3 mixes good
    images with HTTP errors, 4 and 5 hold the bad ones.
    """
    root.mkdir()
    good = []
    for i in range(14):
        w, h = int(rng.integers(10, 60)), int(rng.integers(10, 60))
        mode, fmt = [("RGB", "JPEG"), ("RGBA", "PNG"), ("L", "PNG")][i % 3]
        arr = rng.integers(0, 256, (h, w, len(mode)), dtype=np.uint8)
        img = Image.fromarray(arr[..., 0] if mode == "L" else arr, mode)
        name = f"img{i}.{fmt.lower().replace('jpeg', 'jpg')}"
        (root / name).write_bytes(_encode(img, fmt))
        good.append((name, f"picture {i}, {w}x{h}", "success"))
    jpeg = _encode(Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)), "JPEG")
    png = _encode(Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)), "PNG")
    (root / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (root / "corrupt.png").write_bytes(png[:60] + bytes([png[60] ^ 0xFF]) + png[61:])  # IDAT fails its CRC
    (root / "page.jpg").write_bytes(b"<!doctype html><html><body>not an image</body></html>")
    (root / "empty.jpg").write_bytes(b"")
    refused = f"http://127.0.0.1:{_free_port()}/img.jpg"
    bad_3 = [("missing1.jpg", "gone", "http_404"), ("error", "server error", "http_500")]
    bad_4 = [
        ("slow1", "slow one", "timeout"),
        ("slow2", "slow two", "timeout"),
        ("truncated.jpg", "half a jpeg", "truncated_image"),
        ("corrupt.png", "bad crc", "corrupt_image"),
    ]
    bad_5 = [
        ("page.jpg", "html page", "not_an_image"),
        ("empty.jpg", "zero bytes", "empty_response"),
        (refused, "nobody listens", "connection_refused"),
        ("missing2.jpg", "gone too", "http_404"),
    ]
    return good[:12] + good[12:] + bad_3 + bad_4 + bad_5


def write_list(path, base_url, rows) -> None:
    import csv

    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["url", "caption"])
        writer.writerows((p if "://" in p else base_url + p, c) for p, c, _ in rows)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    rng = np.random.default_rng()
    root = tmp_path_factory.mktemp("site") / "www"
    rows = make_site(root, rng)
    with serve(str(root), handler_cls=BadHandler) as server:
        yield server, rows, tmp_path_factory.mktemp("fetch")


def test_fetch_counts_every_failure_by_reason_then_resumes_without_refetching(site):
    server, rows, work = site
    urls, out = work / "urls.csv", work / "raw"
    write_list(urls, server.url, rows)
    cfg = FetchConfig(
        urls=str(urls),
        out=str(out),
        image_size=IMAGE_SIZE,
        samples_per_shard=PER_SHARD,
        timeout_s=TIMEOUT_S,
        num_threads=4,
    )
    result = run(cfg)

    c = result.counts
    assert (c["num_urls"], c["num_success"], c["num_failed"]) == (24, 14, 10)
    assert c["failed_by_reason"] == EXPECTED_FAILURES
    assert (c["num_shards"], c["num_shards_resumed"], c["num_shards_unfinished"]) == (6, 0, 0)
    assert result.outputs == {"shards": str(out)}
    assert result.details["this_run"]["num_urls"] == 24 and result.details["this_run"]["urls_per_s"] > 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "done" and manifest["counts"]["failed_by_reason"] == EXPECTED_FAILURES
    # every URL was requested exactly once (the refused one never reached the server)
    served = [p for p, _, reason in rows if "://" not in p]
    assert sum(server.request_counts.values()) == len(served)
    assert not (out / "_tmp").exists()

    # the layout: good samples in the tars, every row in the parquets, img2dataset's json fields
    import pyarrow.parquet as pq

    captions = {}
    for shard in range(6):
        name = layout.shard_stem(shard)
        for key, files in read_tar(out / f"{name}.tar").items():
            assert set(files) == {"jpg", "txt", "json"}
            meta = json.loads(files["json"])
            assert list(meta) == list(PARQUET_COLUMNS) and meta["key"] == key and meta["status"] == "success"
            assert files["txt"].decode() == meta["caption"]
            assert Image.open(io.BytesIO(files["jpg"])).size == (IMAGE_SIZE, IMAGE_SIZE)
            captions[meta["caption"]] = meta["url"]
        table = pq.read_table(out / f"{name}.parquet").to_pylist()
        assert len(table) == PER_SHARD
        stats = json.loads((out / f"{name}_stats.json").read_text())
        assert stats["count"] == PER_SHARD
    assert sorted(captions) == sorted(c for _, c, reason in rows if reason == "success")

    # simulate a crash in shard 1: its stats file never written, img2dataset's _tmp/ left behind
    (out / "00001_stats.json").unlink()
    (out / "_tmp").mkdir()
    (out / "_tmp" / "1.feather").write_bytes(b"stale")
    kept = {p.name: p.stat().st_mtime_ns for p in out.glob("0000[02345].tar")}
    server.reset_counts()
    config = work / "fetch.yaml"  # required keys from a file, the rest as options (file < options)
    config.write_text(f"urls: {urls}\nout: {out}\nimage_size: 999\nnum_threads: 4\n")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "toolkit",
            "data",
            "fetch",
            "-c",
            str(config),
            "--image-size",
            str(IMAGE_SIZE),
            "--samples-per-shard",
            str(PER_SHARD),
            "--timeout",
            str(TIMEOUT_S),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "24 URLs: 14 ok, 10 failed" in proc.stdout and "(5 resumed)" in proc.stdout
    assert "this run: 4 URLs" in proc.stdout
    shard_1 = ["/" + p for p, _, _ in rows[4:8]]
    assert dict(server.request_counts) == {p: 1 for p in shard_1}  # only shard 1 was downloaded again
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("0000[02345].tar")} == kept
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["failed_by_reason"] == EXPECTED_FAILURES
    assert manifest["counts"]["num_shards_resumed"] == 5 and not (out / "_tmp").exists()

    # resuming with settings or a list that change the output is refused before anything is downloaded
    with pytest.raises(ValueError, match="image_size changed"):
        run(FetchConfig(urls=str(urls), out=str(out), image_size=IMAGE_SIZE + 1, samples_per_shard=PER_SHARD))
    same = FetchConfig(urls=str(urls), out=str(out), image_size=IMAGE_SIZE, samples_per_shard=PER_SHARD)
    os.utime(urls)  # touched, same bytes: still resumable
    assert check_resumable(same, str(out), "csv", None) == manifest["details"]["urls_sha256"]
    with open(urls, "a") as fh:
        fh.write(f"{server.url}img0.jpg,one more row\n")
    with pytest.raises(ValueError, match="urls.csv changed since"):
        run(same)


def test_fetch_without_any_valid_sample_fails_and_records_why(site):
    server, _, work = site
    urls = work / "dead.txt"  # a txt list: one URL a line, no captions
    urls.write_text("".join(f"{server.url}nothing{i}.jpg\n" for i in range(3)))
    out = work / "dead"
    with pytest.raises(
        RuntimeError, match=r"no image downloaded .*http_404: 3"
    ):  # through img2dataset's pool
        run(FetchConfig(urls=str(urls), out=str(out), timeout_s=TIMEOUT_S, num_threads=2, num_processes=2))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["counts"]["failed_by_reason"] == {"http_404": 3}
    assert manifest["counts"]["num_success"] == 0


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl", "parquet", "csv.gz"])
def test_url_list_formats_and_missing_columns_are_named(tmp_path, fmt):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / f"list.{fmt}"
    rows = [{"link": "http://127.0.0.1:1/a.jpg", "text": "a cat"}]
    if fmt == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        sep = "\t" if fmt == "tsv" else ","
        text = f"link{sep}text\n" + "".join(f"{r['link']}{sep}{r['text']}\n" for r in rows)
        path.write_bytes(gzip.compress(text.encode()) if fmt.endswith(".gz") else text.encode())
    assert detect_format(str(path)) == fmt and detect_format(str(tmp_path)) == fmt  # a file, a folder
    assert check_url_list(str(path), fmt, "link", "text") == "text"
    assert check_url_list(str(tmp_path), fmt, "link", "") is None  # a folder of lists, no captions
    with pytest.raises(ValueError, match=r"no column 'caption' \(caption_col\); columns are: link, text"):
        check_url_list(str(path), fmt, "link", "caption")
    with pytest.raises(ValueError, match=r"no column 'url' \(url_col\)"):
        check_url_list(str(path), fmt, "url", "")


def test_url_list_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="URL list not found"):
        run(FetchConfig(urls=str(tmp_path / "none.csv"), out=str(tmp_path / "o")))
    (tmp_path / "list.xlsx").write_text("x")
    with pytest.raises(ValueError, match="cannot tell the URL list format"):
        run(FetchConfig(urls=str(tmp_path / "list.xlsx"), out=str(tmp_path / "o")))
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        with pytest.raises(ValueError, match="distributor 'ray' needs the ray package"):
            run(FetchConfig(urls=str(tmp_path / "list.xlsx"), out=str(tmp_path / "o"), distributor="ray"))
    assert not (tmp_path / "o").exists()  # nothing written for bad input


@pytest.mark.parametrize(
    "message, reason",
    [
        ("success", "success"),
        ("HTTP Error 404: Not Found", "http_404"),
        ("HTTP Error 503: Service Unavailable", "http_503"),
        ("<urlopen error timed out>", "timeout"),
        ("The read operation timed out", "timeout"),
        ("<urlopen error [Errno 111] Connection refused>", "connection_refused"),
        ("<urlopen error [Errno -2] Name or service not known>", "dns_error"),
        ("Remote end closed connection without response", "connection_error"),
        ("IncompleteRead(10 bytes read, 90 more expected)", "incomplete_transfer"),
        ("<urlopen error [Errno 2] No such file or directory: '/x.jpg'>", "file_not_found"),
        ("unknown url type: 'abc'", "bad_url"),
        ("Use of image disallowed by X-Robots-Tag directive", "disallowed_by_robots_tag"),
        ("Image decoding error", "decode_error"),
        ("image too small", "image_too_small"),
        (
            "not an image: Pillow cannot identify the format (first bytes b'HTTP Error 404 timed out')",
            "not_an_image",
        ),
        ("missing caption: no a.txt beside the image", "missing_caption"),
        ("something nobody expected", "other"),
    ],
)
def test_classify_messages(message, reason):
    assert reasons.classify(message) == reason


def check_image_bytes(data: bytes) -> str | None:
    """None when Pillow fully decodes ``data``, else resizer.decode_image's error message."""
    return decode_image(data)[1]


def test_strict_check_rejects_truncated_corrupt_bombs_and_non_images(monkeypatch):
    rng = np.random.default_rng()
    img = Image.fromarray(rng.integers(0, 256, (31, 17, 3), dtype=np.uint8))
    jpeg, png = _encode(img, "JPEG"), _encode(img, "PNG")
    assert check_image_bytes(jpeg) is None and check_image_bytes(png) is None
    assert reasons.classify(check_image_bytes(jpeg[: len(jpeg) // 2])) == "truncated_image"
    assert reasons.classify(check_image_bytes(png[:-30])) == "truncated_image"
    assert (
        reasons.classify(check_image_bytes(png[:60] + bytes([png[60] ^ 0xFF]) + png[61:])) == "corrupt_image"
    )
    assert reasons.classify(check_image_bytes(rng.bytes(300))) == "not_an_image"
    assert reasons.classify(check_image_bytes(b"")) == "empty_response"
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 31x17 = 527 pixels > 2x the limit: a bomb
    assert reasons.classify(check_image_bytes(png)) == "decompression_bomb"


def test_summarize_adds_up_and_reports_unrecorded_samples():
    stats = {
        0: {
            "count": 5,
            "start_time": 10.0,
            "end_time": 12.0,
            "status_dict": {
                "success": 2,
                "HTTP Error 404: Not Found": 1,
                "cannot identify image file <_io.BytesIO object at 0x7f00aa>": 1,
            },
        },
        1: {"count": 3, "start_time": 11.0, "end_time": 15.5, "status_dict": {"success": 3}},
    }
    s = reasons.summarize(stats)
    assert (s["num_samples"], s["num_success"], s["num_failed"]) == (8, 5, 3)
    assert s["failed_by_reason"] == {"http_404": 1, "other": 1, "unrecorded": 1}
    assert "cannot identify image file <_io.BytesIO object>" in s["messages"] and s["span_s"] == 5.5


@pytest.mark.slow
def test_run_timeout_stops_a_stalled_run_and_malformed_lists_fail_clearly(tmp_path):
    with socket.socket() as silent:  # accepts connections (backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        urls = tmp_path / "stalled.txt"
        urls.write_text("".join(f"http://127.0.0.1:{silent.getsockname()[1]}/{i}.jpg\n" for i in range(4)))
        # without the run limit each URL would wait out its 120 s socket timeout and fail as 'timeout'
        with pytest.raises(RuntimeError, match="stopped after run_timeout_s=6"):
            run(FetchConfig(urls=str(urls), out=str(tmp_path / "o"), timeout_s=120, run_timeout_s=6))
    bad = tmp_path / "bad.csv"
    bad.write_text('url,caption\n"http://127.0.0.1:1/a.jpg,unterminated\n')
    # one bad row no longer aborts the run with pyarrow's traceback: it is skipped, named by its line
    with pytest.raises(
        RuntimeError,
        match=r"no image downloaded .*1 rows skipped as malformed_row, e\.g\. "
        r".*bad\.csv line 2: bad quoting: unexpected end of data",
    ):
        run(FetchConfig(urls=str(bad), out=str(tmp_path / "o2")))


def test_resume_fetches_again_finished_shards_whose_tar_parquet_and_stats_disagree(site):
    import tarfile

    from toolkit.data.raw.verify import check_shard

    server, rows, work = site
    urls, out = work / "verify.csv", work / "verify"
    write_list(urls, server.url, rows[:12])  # good images only: 3 shards of 4
    cfg = FetchConfig(
        urls=str(urls),
        out=str(out),
        image_size=IMAGE_SIZE,
        samples_per_shard=PER_SHARD,
        timeout_s=TIMEOUT_S,
        num_threads=4,
    )
    assert run(cfg).counts["num_success"] == 12
    assert all(check_shard(str(out), i) is None for i in range(3))
    # shard 0: cut at a member boundary (tarfile sees a complete tar); shard 1: stats and parquet disagree
    tar0 = out / "00000.tar"
    with tarfile.open(tar0) as tar:
        boundary = tar.getmembers()[-3].offset
    tar0.write_bytes(tar0.read_bytes()[:boundary])
    stats1 = json.loads((out / "00001_stats.json").read_text())
    (out / "00001_stats.json").write_text(json.dumps({**stats1, "count": 9}))
    kept = (out / "00002.tar").stat().st_mtime_ns
    server.reset_counts()

    result = run(cfg)
    redone = result.details["shards_redone"]
    assert sorted(redone) == ["00000", "00001"]
    assert "no end-of-archive marker" in redone["00000"] and "stats file says 9" in redone["00001"]
    assert result.counts["num_shards_redone"] == 2 and result.counts["num_shards_resumed"] == 1
    assert dict(server.request_counts) == {"/" + p: 1 for p, _, _ in rows[:8]}  # shards 0 and 1 only
    assert (out / "00002.tar").stat().st_mtime_ns == kept
    assert all(check_shard(str(out), i) is None for i in range(3)) and len(read_tar(tar0)) == 4
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["details"]["shards_redone"] == redone and manifest["counts"]["num_success"] == 12
    assert check_shard(str(out), 2, deep=False) is None
    (out / "00002.tar").write_bytes((out / "00002.tar").read_bytes()[:boundary])
    assert "does not end with its end-of-archive marker" in check_shard(str(out), 2, deep=False)


HOLDER = """
import sys, time
from pathlib import Path
from toolkit.data.acquire.fetch_config import KIND, FetchConfig
from toolkit.core.stage import stage_run

cfg = FetchConfig(urls=sys.argv[1], out=sys.argv[2])
with stage_run(KIND, cfg, cfg.out):
    Path(sys.argv[3]).write_text("fetching")
    time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_second_fetch_into_the_same_out_fails_at_once_naming_the_first(tmp_path):
    urls, out, ready = tmp_path / "urls.txt", tmp_path / "raw", tmp_path / "ready"
    urls.write_text("http://127.0.0.1:1/a.jpg\n")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    first = subprocess.Popen([sys.executable, "-c", HOLDER, str(urls), str(out), str(ready)], env=env)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        second = subprocess.run(
            [sys.executable, "-m", "toolkit", "data", "fetch", "--urls", str(urls), "--out", str(out)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    finally:
        first.kill()
        first.wait(30)
    assert second.returncode == 1
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"{out} is in use by another run (pid {first.pid} on " in errors[0]
    assert "Traceback" not in second.stderr and not (out / "_tmp").exists()
    assert (
        json.loads((out / "manifest.json").read_text())["status"] == "running"
    )  # the first run's, untouched


@pytest.mark.timeout(120)
def test_shards_without_a_manifest_are_resumed_only_if_they_hold_this_lists_rows(site):
    """A folder of shards without a manifest (img2dataset run by hand, a copied folder) was resumed 'on the
    assumption they come from' the list: shards of another shard size or list counted as fetched, and the
    list's other URLs in those shard positions were never requested."""
    server, rows, work = site
    urls, out = work / "foreign.csv", work / "foreign"
    write_list(urls, server.url, rows[:6])  # good images only
    first = FetchConfig(
        urls=str(urls),
        out=str(out),
        image_size=IMAGE_SIZE,
        samples_per_shard=2,
        timeout_s=TIMEOUT_S,
        num_threads=4,
    )
    assert run(first).counts["num_success"] == 6
    (out / "manifest.json").unlink()  # now the folder looks like img2dataset's own output
    with pytest.raises(
        ValueError,
        match=r"foreign/00000.parquet: holds 2 rows where this list and shard size "
        r"put 4: .* \(no manifest\)",
    ):
        run(
            FetchConfig(
                urls=str(urls),
                out=str(out),
                image_size=IMAGE_SIZE,
                samples_per_shard=PER_SHARD,
                timeout_s=TIMEOUT_S,
                num_threads=4,
            )
        )
    other = work / "foreign_other.csv"
    write_list(other, server.url, rows[1:7])
    with pytest.raises(
        ValueError,
        match=r"foreign/00000.parquet: holds '.*img0.jpg', which is not among the 2 "
        r"URLs this list puts in that shard",
    ):
        run(
            FetchConfig(
                urls=str(other),
                out=str(out),
                image_size=IMAGE_SIZE,
                samples_per_shard=2,
                timeout_s=TIMEOUT_S,
                num_threads=4,
            )
        )
    assert not (out / "manifest.json").exists() and len(list(out.glob("*.tar"))) == 3  # nothing touched
