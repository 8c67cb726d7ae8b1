"""One formatter and one line length for the whole repository: ``ruff format`` (line length 110, set in
pyproject.toml, ruff pinned in the dev extras so a fresh machine formats the same) leaves every file as it is,
and ``ruff check`` (the lint rules pyproject.toml selects) finds nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PATHS = ("toolkit", "tests", "benchmarks", "scripts")


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def test_every_file_is_as_the_formatter_writes_it():
    proc = _ruff("format", "--check", *PATHS)
    assert proc.returncode == 0, (
        "run `ruff format toolkit tests benchmarks scripts`:\n" + proc.stdout[-3000:] + proc.stderr[-2000:]
    )


def test_the_lint_rules_hold():
    proc = _ruff("check", "--output-format", "concise", *PATHS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
