"""Tracebacks and messages without the culprit (issue 43, items 13-17): each case is a real `toolkit` run
that must end with exactly one error line naming the option, file, URL or server, and no traceback."""

from __future__ import annotations

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
