"""`toolkit data fetch` against hostile and careless URL lists: local-file and other non-http schemes,
oversize bodies, malformed rows and duplicate URLs. One real HTTP server on 127.0.0.1."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from datakit import read_tar
from PIL import Image

from toolkit.data.acquire.fetch import run
from toolkit.data.acquire.fetch_config import DEFAULT_MAX_BYTES, FetchConfig
from toolkit.data.acquire.serve import QuietHandler, serve

STREAM_BYTES = 64 * 2**20  # what the oversize endpoints would send: far above the limits used here
MAX_BYTES = 2**20
SECRET = b"root:x:0:0:SECRET-MARKER:/root:/bin/bash\n"


class HostileHandler(QuietHandler):
    """Static files plus /huge (64 MiB, no Content-Length), /announced (claims 10 GiB) and /to-ftp (a
    redirect to ftp://). Bytes actually sent per path are counted in server.sent."""

    def send_head(self):
        path = self.path.split("?", 1)[0]
        if path in ("/huge", "/announced", "/to-ftp"):
            self.server.request_counts[path] += 1
            if path == "/to-ftp":
                self.send_response(302)
                self.send_header("Location", "ftp://127.0.0.1:1/secret.jpg")
                self.end_headers()
                return None
            self.send_response(200)
            self.send_header("Content-Type", "image/jpeg")
            if path == "/announced":
                self.send_header("Content-Length", str(10 * 2**30))
            self.end_headers()
            self._stream(path)
            return None
        return super().send_head()

    def _stream(self, path: str) -> None:
        block, sent = b"\xff\xd8\xff\xe0" + bytes(2**16 - 4), 0
        try:
            while sent < STREAM_BYTES:
                self.wfile.write(block)
                sent += len(block)
        except OSError:
            pass  # the client hung up: what it refused was never sent
        finally:
            with self.server.count_lock:
                self.server.sent[path] = self.server.sent.get(path, 0) + sent
            self.close_connection = True


def _png(rng, side: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    rng = np.random.default_rng(3)
    root = tmp_path_factory.mktemp("hostile") / "www"
    root.mkdir()
    for i in range(6):
        (root / f"ok{i}.png").write_bytes(_png(rng, 20 + i))
    (root / "big.png").write_bytes(_png(rng, 700))  # a real image, about 1.4 MiB: over MAX_BYTES
    local = tmp_path_factory.mktemp("local")
    (local / "secret.txt").write_bytes(SECRET)
    (local / "photo.png").write_bytes(_png(rng, 30))
    with serve(str(root), handler_cls=HostileHandler) as server:
        server.sent = {}
        yield server, local, tmp_path_factory.mktemp("work")


def _write_csv(path, rows) -> None:
    import csv

    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["url", "caption"])
        writer.writerows(rows)


def _all_output_bytes(out) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(out.iterdir()) if p.is_file())


@pytest.mark.timeout(300)
def test_only_http_and_https_unless_opted_in_and_no_body_is_quoted(hostile):
    server, local, work = hostile
    png = base64.b64encode(_png(np.random.default_rng(0), 8)).decode()
    urls = work / "schemes.csv"
    _write_csv(
        urls,
        [
            ((local / "secret.txt").as_uri(), "a local file"),
            ((local / "photo.png").as_uri(), "local"),
            (f"data:image/png;base64,{png}", "inline"),
            ("ftp://127.0.0.1:1/secret.jpg", "ftp"),
            (server.url + "to-ftp", "redirected to ftp"),
            (server.url + "ok0.png", "fine"),
            ("127.0.0.1/ok1.png", "no scheme"),
        ],
    )
    out = work / "schemes"
    result = run(FetchConfig(urls=str(urls), out=str(out), image_size=16, timeout_s=5, num_threads=2))
    c = result.counts
    assert (c["num_urls"], c["num_success"]) == (7, 1)
    assert c["failed_by_reason"] == {"disallowed_scheme": 5, "bad_url": 1}
    assert server.request_counts["/to-ftp"] == 1 and "/ok1.png" not in server.request_counts
    messages = result.details["error_messages"]
    assert any("disallowed url scheme 'ftp' in a redirect" in m for m in messages)
    assert any("disallowed url scheme 'file'" in m and "--allow-schemes" in m for m in messages)
    assert SECRET[:12] not in _all_output_bytes(out)
    assert [json.loads(s["json"])["caption"] for s in read_tar(out / "00000.tar").values()] == ["fine"]

    # opted in: local files are read, and a non-image's bytes still go nowhere (parquet, manifest, log)
    opted = work / "opted"
    result = run(
        FetchConfig(
            urls=str(urls), out=str(opted), image_size=16, timeout_s=5, num_threads=2, allow_schemes=["file"]
        )
    )
    assert result.counts["num_success"] == 2
    assert result.counts["failed_by_reason"] == {"disallowed_scheme": 3, "bad_url": 1, "not_an_image": 1}
    assert SECRET[:12] not in _all_output_bytes(opted) and b"SECRET-MARKER" not in _all_output_bytes(opted)


@pytest.mark.timeout(300)
def test_downloads_over_max_bytes_are_aborted_while_streaming(hostile):
    server, _, work = hostile
    assert DEFAULT_MAX_BYTES == 50 * 2**20 and FetchConfig(urls="u", out="o").max_bytes == DEFAULT_MAX_BYTES
    urls = work / "sizes.csv"
    _write_csv(
        urls,
        [
            (server.url + "huge", "endless"),
            (server.url + "announced", "says 10 GiB"),
            (server.url + "big.png", "a real 1.4 MiB image"),
            (server.url + "ok2.png", "small"),
        ],
    )
    out = work / "sizes"
    server.sent.clear()
    result = run(
        FetchConfig(
            urls=str(urls), out=str(out), image_size=16, timeout_s=10, num_threads=4, max_bytes=MAX_BYTES
        )
    )
    c = result.counts
    assert (c["num_success"], c["failed_by_reason"]) == (1, {"too_large": 3})
    messages = " | ".join(result.details["error_messages"])
    assert f"Content-Length {10 * 2**30} bytes exceeds max_bytes={MAX_BYTES}" in messages
    assert f"more than max_bytes={MAX_BYTES} bytes received" in messages
    # aborted while streaming: the client hung up long before the 64 MiB were sent (socket buffers aside)
    assert server.sent["/huge"] < STREAM_BYTES // 2 and server.sent["/announced"] < STREAM_BYTES // 2


@pytest.mark.timeout(300)
def test_malformed_rows_and_duplicate_urls_are_skipped_and_counted_with_line_numbers(hostile):
    server, _, work = hostile
    u = server.url
    urls = work / "messy.csv"
    urls.write_bytes(
        b"\xef\xbb\xbf"
        + (  # saved by a spreadsheet: a UTF-8 byte order mark
            "url,caption\n"
            f"{u}ok3.png,first\n"
            f"{u}ok4.png,one,field too many\n"  # line 3
            f"{u}ok3.png,the same URL again\n"  # line 4
            f'{u}ok5.png,"a stray" quote\n'  # line 5
            f"{u}ok0.png,zero\n"
            f"{u}ok3.png,and a third time\n"  # line 7
        ).encode()
        + f"{u}ok1.png,caf\xe9\n".encode("latin-1")
        + f"{u}ok2.png,two\n".encode()
    )  # line 8
    server.reset_counts()
    out = work / "messy"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
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
            "--threads",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "8 rows in the list: 5 skipped (duplicate_url 2, malformed_row 3;" in proc.stdout
    assert "3 URLs: 3 ok, 0 failed" in proc.stdout
    assert server.request_counts["/ok3.png"] == 1  # the first occurrence only
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["skipped_rows"] == {"duplicate_url": 2, "malformed_row": 3}
    listed = manifest["details"]["skipped_row_lines"]
    assert [line.split(": ", 1)[0] for line in listed["malformed_row"]] == [
        f"{urls} line 3",
        f"{urls} line 5",
        f"{urls} line 8",
    ]
    assert "3 field(s), the header has 2" in listed["malformed_row"][0]
    assert "not UTF-8" in listed["malformed_row"][2]
    assert listed["duplicate_url"] == [
        f"{urls} line 4: same URL as {urls} line 2: {u}ok3.png",
        f"{urls} line 7: same URL as {urls} line 2: {u}ok3.png",
    ]
    captions = sorted(json.loads(s["json"])["caption"] for s in read_tar(out / "00000.tar").values())
    assert captions == ["first", "two", "zero"]


class ToFileHandler(QuietHandler):
    """Static files plus /to-file: a redirect to a local file."""

    def send_head(self):
        if self.path.startswith("/to-file"):
            self.server.request_counts[self.path] += 1
            self.send_response(302)
            self.send_header("Location", "file:///etc/hostname")
            self.end_headers()
            return None
        return super().send_head()


@pytest.mark.timeout(300)
def test_redirect_to_file_is_a_disallowed_scheme(tmp_path):
    """A redirect to file:// (refused by urllib itself) was counted as http_302 instead of
    disallowed_scheme."""
    www = tmp_path / "www"
    www.mkdir()
    (www / "ok.png").write_bytes(_png(np.random.default_rng(5), 20))
    with serve(str(www), handler_cls=ToFileHandler) as server:
        urls = tmp_path / "urls.csv"
        _write_csv(
            urls, [(server.url + "ok.png", "fine"), (server.url + "to-file", "redirected to a local file")]
        )
        result = run(
            FetchConfig(urls=str(urls), out=str(tmp_path / "out"), image_size=16, timeout_s=5, num_threads=2)
        )
    assert result.counts["num_success"] == 1 and result.counts["failed_by_reason"] == {"disallowed_scheme": 1}


@pytest.mark.timeout(300)
def test_bomb_below_pillows_own_limit_is_refused(tmp_path):
    """A 10,000 x 10,000 PNG (100 MP: over cliptk's 89.5 MP limit, under the 179 MP at which Pillow refuses by
    itself) was downloaded, fully decoded and stored, and precompute then skipped it as a decompression
    bomb."""
    www = tmp_path / "www"
    www.mkdir()
    (www / "ok.png").write_bytes(_png(np.random.default_rng(5), 20))
    buf = io.BytesIO()
    Image.new("1", (10_000, 10_000)).save(buf, "PNG")  # about 12 kB on disk
    (www / "bomb.png").write_bytes(buf.getvalue())
    with serve(str(www)) as server:
        urls = tmp_path / "urls.csv"
        _write_csv(urls, [(server.url + "ok.png", "fine"), (server.url + "bomb.png", "bomb")])
        result = run(
            FetchConfig(urls=str(urls), out=str(tmp_path / "out"), image_size=16, timeout_s=5, num_threads=2)
        )
    assert result.counts["num_success"] == 1 and result.counts["failed_by_reason"] == {
        "decompression_bomb": 1
    }
    assert any("10000x10000 = 100,000,000 pixels" in m for m in result.details["error_messages"])


@pytest.mark.timeout(300)
def test_urls_with_spaces_and_non_ascii_characters_are_percent_encoded(tmp_path):
    """urllib sends a URL as given: 'http://host/fotos/ü ñ.png' failed with "'ascii' codec can't encode
    character" (reason other) or "URL can't contain control characters" (bad_url), where a browser (and
    the server) fetch it percent-encoded. Real URL lists hold many such URLs."""
    from toolkit.data.acquire.download import to_uri

    assert (
        to_uri("https://bücher.example:8443/a b.jpg?q=é#x")
        == "https://xn--bcher-kva.example:8443/a%20b.jpg?q=%C3%A9#x"
    )
    www = tmp_path / "www"
    (www / "fotos").mkdir(parents=True)
    rng = np.random.default_rng(6)
    for name in ("ü ñ.png", "日本.png", "plain.png", "50%.png"):
        (www / "fotos" / name).write_bytes(_png(rng, 20))
    with serve(str(www)) as server:
        urls = tmp_path / "urls.csv"
        _write_csv(
            urls,
            [
                (server.url + "fotos/ü ñ.png", "spaces and accents"),
                (server.url + "fotos/日本.png?size=大", "CJK path and query"),
                (server.url + "fotos/%E6%97%A5%E6%9C%AC.png", "already percent-encoded"),
                (server.url + "fotos/50%25.png", "an escaped percent sign"),
                (server.url + "fotos/plain.png", "plain"),
            ],
        )
        result = run(
            FetchConfig(urls=str(urls), out=str(tmp_path / "out"), image_size=16, timeout_s=5, num_threads=2)
        )
    assert result.counts["failed_by_reason"] == {} and result.counts["num_success"] == 5
    stored = {json.loads(s["json"])["url"] for s in read_tar(tmp_path / "out" / "00000.tar").values()}
    assert server.url + "fotos/ü ñ.png" in stored  # the list's own spelling is what the shard records


def test_a_url_list_that_is_a_fifo_is_refused_instead_of_waiting(tmp_path):
    """Before: `data fetch --urls FIFO` with no writer waited forever, printing nothing (issue 43 item 7)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    fifo = tmp_path / "urls.csv"
    os.mkfifo(fifo)
    root = Path(__file__).resolve().parents[3]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "toolkit",
            "data",
            "fetch",
            "--urls",
            str(fifo),
            "--out",
            str(tmp_path / "out"),
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(root)),
    )
    assert proc.returncode == 1 and f"{fifo} is a FIFO, not a regular file" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
