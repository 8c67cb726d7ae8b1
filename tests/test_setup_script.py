"""scripts/setup.sh (issue 43 item 22): it printed nothing for about 4 minutes (a quiet pip). A run with work
says each step and lets pip print what it does; a run with nothing to do stays one line. The venv's python
here is a recorder of its calls (a real install takes minutes; README command 2 runs the real one in CI)."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "setup.sh"


def _fake_venv(tmp_path: Path) -> tuple[Path, Path]:
    venv, calls = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    python.chmod(0o755)
    return venv, calls


def _run(venv: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=ROOT,
        env=dict(os.environ, VENV=str(venv)),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_setup_says_each_step_and_lets_pip_speak(tmp_path):
    venv, calls = _fake_venv(tmp_path)
    proc = _run(venv)
    assert proc.returncode == 0, proc.stderr
    steps = [line for line in proc.stdout.splitlines() if line.startswith("setup: [")]
    assert [s.split("]")[0] for s in steps] == ["setup: [1/3", "setup: [2/3", "setup: [3/3"], proc.stdout
    assert "installing cliptk[dev] with torch 2.14.1" in steps[1] and proc.stdout.rstrip().endswith(" s")
    install = [c for c in calls.read_text().splitlines() if " install " in c]
    assert len(install) == 1 and " -q" not in f" {install[0]} ", install  # pip's own lines are shown


def test_a_second_run_with_nothing_to_do_is_one_line(tmp_path):
    venv, calls = _fake_venv(tmp_path)
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + SCRIPT.read_bytes()).hexdigest()
    (venv / ".cliptk-setup-stamp").write_text(want + "\n")
    proc = _run(venv)
    assert proc.returncode == 0 and proc.stdout == f"setup: {venv} is up to date\n", proc.stdout
    assert not calls.exists()
