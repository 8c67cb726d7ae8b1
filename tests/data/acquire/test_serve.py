"""`toolkit data serve`: a folder over real HTTP on 127.0.0.1, as a context manager and as a command."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest

from toolkit.data.acquire.serve import serve


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, b""


def test_serve_context_manager_serves_files_counts_requests_and_404s(tmp_path):
    payload = np.random.default_rng().bytes(1234)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "blob.bin").write_bytes(payload)
    with serve(str(tmp_path)) as server:
        assert server.url.startswith("http://127.0.0.1:") and server.port > 0
        assert _get(server.url + "sub/blob.bin") == (200, payload)
        assert _get(server.url + "sub/blob.bin")[0] == 200
        assert _get(server.url + "nope.jpg")[0] == 404
        assert server.request_counts == {"/sub/blob.bin": 2, "/nope.jpg": 1}
        server.reset_counts()
        assert not server.request_counts
    with pytest.raises(OSError):  # shut down: nothing listens any more
        urllib.request.urlopen(server.url + "sub/blob.bin", timeout=2)


def test_serve_rejects_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        with serve(str(tmp_path / "missing")):
            pass


def test_serve_command_prints_url_of_a_free_port(tmp_path):
    (tmp_path / "hello.txt").write_text("hi there")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(
        [sys.executable, "-m", "toolkit", "data", "serve", str(tmp_path), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith(f"serving {tmp_path.resolve()} at http://127.0.0.1:"), line
        url = line.rsplit(" ", 1)[-1]
        assert _get(url + "hello.txt") == (200, b"hi there")
    finally:
        proc.terminate()
        proc.wait(10)


def test_serve_never_follows_symlinks_out_of_its_folder(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("not for the web")
    root = tmp_path / "www"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "ok.txt").write_text("served")
    (root / "leak.txt").symlink_to(outside / "secret.txt")
    (root / "leakdir").symlink_to(outside, target_is_directory=True)
    (root / "inside.txt").symlink_to(root / "sub" / "ok.txt")  # stays in the folder: fine
    with serve(str(root)) as server:
        assert _get(server.url + "leak.txt")[0] == 404
        assert _get(server.url + "leakdir/secret.txt")[0] == 404
        assert _get(server.url + "leakdir/")[0] == 404
        assert _get(server.url + "inside.txt") == (200, b"served")
        assert _get(server.url + "sub/ok.txt") == (200, b"served")


def test_serve_command_on_a_busy_port_is_one_line(tmp_path):
    with serve(str(tmp_path)) as busy:
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        proc = subprocess.run(
            [sys.executable, "-m", "toolkit", "data", "serve", str(tmp_path), "--port", str(busy.port)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: cannot serve on 127.0.0.1:{busy.port}: Address already in use; pick another with --port, "
        "or --port 0 for a free one"
    ]


def test_serve_stage_runs_in_the_background_and_is_reused_in_one_process(tmp_path):
    """The pipeline kind data.serve: creates its folder, serves files written after it started, and a
    second run with the same folder and port (a pipeline rerun in one process) reuses the server."""
    import urllib.request

    from _launch import free_port

    from toolkit.core.config import build
    from toolkit.data.acquire import serve as serve_stage

    cfg = build(serve_stage.ServeConfig, {"root": str(tmp_path / "site"), "port": free_port()})
    first = serve_stage.run(cfg)
    (tmp_path / "site" / "a.txt").write_text("hello")
    with urllib.request.urlopen(first.outputs["url"] + "a.txt", timeout=10) as resp:
        assert resp.read() == b"hello"
    assert serve_stage.run(cfg).outputs["url"] == first.outputs["url"]
    assert not (tmp_path / "site" / "manifest.json").exists()  # a service keeps no books
