"""Tracebacks and messages without the culprit (issue 43, items 13-17): each case is a real `toolkit` run
that must end with exactly one error line naming the option, file, URL or server, and no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from proctools import env


def _one_error(args: list[str], cwd, extra_env: dict[str, str] | None = None) -> str:
    proc = subprocess.run([sys.executable, "-m", "toolkit", *args], cwd=cwd, env={**env(), **(extra_env or {})},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode in (1, 2), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


@pytest.mark.parametrize(("args", "words"), [
    (["train", "--data", "", "--out", "RUN"], "option --data: data: is empty"),
    (["train", "--set", "data=", "--out", "RUN"], "--set data=: data: is empty"),
    (["train", "--data", "D", "--out", ""], "option --out: out: is empty"),
    (["data", "precompute", "--in", " ", "--out", "RUN", "--model", "cliptk-tiny"], "option --in: input: is empty"),
])
def test_an_empty_path_option_is_named(tmp_path, args, words):
    """Item 16: `--data ''` said "/dataset.json: not found; is  a precompute output directory?"."""
    args = [str(tmp_path / a) if a in ("RUN", "D") else a for a in args]
    line = _one_error(args, tmp_path)
    assert words in line, line


def test_a_config_file_that_is_a_fifo_is_named(tmp_path):
    """Item 15: `--config FIFO` ended in a 55-line traceback."""
    fifo = tmp_path / "cfg.yaml"
    os.mkfifo(fifo)
    line = _one_error(["train", "--config", str(fifo), "--data", "D", "--out", str(tmp_path / "run")], tmp_path)
    assert f"{fifo}: is a FIFO" in line, line


def test_a_parquet_url_list_that_is_not_parquet_is_named(tmp_path):
    """Item 15: pyarrow's `ArrowInvalid: Parquet magic bytes not found` named no file."""
    urls = tmp_path / "urls.parquet"
    urls.write_text("url,caption\nhttp://127.0.0.1:9/a.jpg,a\n")
    line = _one_error(["data", "fetch", "--urls", str(urls), "--out", str(tmp_path / "raw")], tmp_path)
    assert f"{urls}: not a readable parquet file" in line, line


@pytest.fixture
def full_disk(tmp_path):
    """A 64 KiB tmpfs filled to the last byte (mounting needs root: skipped elsewhere)."""
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        with open(mount / "filler", "wb") as fh:
            try:
                fh.write(b"\0" * (1 << 20))
            except OSError:
                pass
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_out_folder_is_named(tmp_path, full_disk):
    """Item 15: an `--out` on a 100 % full filesystem ended in a bare `OSError: [Errno 28]` naming no path."""
    out = full_disk / "demo"
    line = _one_error(["data", "demo", "--out", str(out), "--limit", "2"], tmp_path)
    assert "No space left on device" in line and f"--out {out}: 0 bytes free" in line, line
