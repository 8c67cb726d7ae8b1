"""Tracebacks and messages without the culprit (issue 43, items 13-17): each case is a real `toolkit` run
that must end with exactly one error line naming the option, file, URL or server, and no traceback."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
from proctools import env


def _one_error(args: list[str], cwd, extra_env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "toolkit", *args],
        cwd=cwd,
        env={**env(), **(extra_env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode in (1, 2), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["train", "--data", "", "--out", "RUN"], "option --data: data: is empty"),
        (["train", "--set", "data=", "--out", "RUN"], "--set data=: data: is empty"),
        (["train", "--data", "D", "--out", ""], "option --out: out: is empty"),
        (
            ["data", "precompute", "--in", " ", "--out", "RUN", "--model", "cliptk-tiny"],
            "option --in: input: is empty",
        ),
    ],
)
def test_an_empty_path_option_is_named(tmp_path, args, words):
    """Item 16: `--data ''` said "/dataset.json: not found; is  a precompute output directory?"."""
    args = [str(tmp_path / a) if a in ("RUN", "D") else a for a in args]
    line = _one_error(args, tmp_path)
    assert words in line, line


def test_a_config_file_that_is_a_fifo_is_named(tmp_path):
    """Item 15: `--config FIFO` ended in a 55-line traceback."""
    fifo = tmp_path / "cfg.yaml"
    os.mkfifo(fifo)
    line = _one_error(
        ["train", "--config", str(fifo), "--data", "D", "--out", str(tmp_path / "run")], tmp_path
    )
    assert f"{fifo}: is a FIFO" in line, line


def test_a_parquet_url_list_that_is_not_parquet_is_named(tmp_path):
    """Item 15: pyarrow's `ArrowInvalid: Parquet magic bytes not found` named no file."""
    urls = tmp_path / "urls.parquet"
    urls.write_text("url,caption\nhttp://127.0.0.1:9/a.jpg,a\n")
    line = _one_error(["data", "fetch", "--urls", str(urls), "--out", str(tmp_path / "raw")], tmp_path)
    assert f"{urls}: not a readable parquet file" in line, line


def _unshare_works() -> bool:
    return (
        shutil.which("unshare") is not None
        and subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0
    )


@pytest.mark.skipif(not _unshare_works(), reason="no unprivileged user+mount namespaces (unshare -rm) here")
def test_a_full_out_folder_is_named(tmp_path):
    """Item 15: an `--out` on a 100 % full filesystem ended in a bare `OSError: [Errno 28]` naming no path.
    A real tmpfs of 64 KiB, filled to the last byte, in a user and mount namespace (no root needed)."""
    full = tmp_path / "full"
    full.mkdir()
    cmd = f"{sys.executable} -m toolkit data demo --out {full}/demo --limit 2"
    script = (
        f"mount -t tmpfs -o size=64k tmpfs {full} && (head -c 1048576 /dev/zero > {full}/filler; "
        f"{cmd}; echo rc=$?)"
    )
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], env=env(), capture_output=True, text=True, timeout=120
    )
    assert "rc=1" in proc.stdout and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert "No space left on device" in errors[0] and f"--out {full}/demo: 0 bytes free" in errors[0], errors


def _closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    ("args", "url"),
    [
        (
            ["train", "--data", "hf://datasets/someone/set", "--out", "RUN"],
            "hf://datasets/someone/set/dataset.json",
        ),
        (
            ["data", "fetch", "--urls", "hf://datasets/someone/set/urls.csv", "--out", "RUN"],
            "hf://datasets/someone/set/urls.csv",
        ),
    ],
)
def test_an_unreachable_hf_path_is_one_line(tmp_path, args, url):
    """Item 13: `hf://` paths without network ended in 138 (train) and 127 (fetch) lines of traceback. The
    hub's endpoint is a closed port on 127.0.0.1, so nothing leaves the machine."""
    hub = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}"}
    line = _one_error([str(tmp_path / a) if a == "RUN" else a for a in args], tmp_path, hub)
    assert url in line and "cannot read it from its server" in line and "Connection refused" in line, line


def test_an_http_training_set_whose_server_is_gone_is_not_called_missing(tmp_path):
    """Item 17 (the command's side; tests/data/trainset/test_server_gone.py stops a real server mid-read)."""
    url = f"http://127.0.0.1:{_closed_port()}/train"
    line = _one_error(["train", "--data", url, "--out", str(tmp_path / "run")], tmp_path)
    assert f"{url}/dataset.json: cannot read it from its server" in line and "not found" not in line, line
