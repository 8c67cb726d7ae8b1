"""The `toolkit` command: help, version, lazy imports, shared options."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from toolkit import __version__
from toolkit.cli.main import app


def test_help_lists_groups_and_version():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for group in ("data", "train", "eval", "pipeline"):
        assert group in result.output
    version = CliRunner().invoke(app, ["--version"])
    assert version.exit_code == 0 and version.output.strip() == f"cliptk {__version__}"


def test_startup_imports_no_heavy_modules():
    code = ("import sys; from toolkit.cli.main import app; "
            "heavy = [m for m in ('torch', 'open_clip', 'webdataset', 'img2dataset', 'numpy') if m in sys.modules]; "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_bad_log_level_and_unknown_command():
    assert CliRunner().invoke(app, ["--log-level", "LOUD", "pipeline", "kinds"]).exit_code == 2
    assert CliRunner().invoke(app, ["nope"]).exit_code == 2


def test_pipeline_kinds_lists_shell_keys():
    result = CliRunner().invoke(app, ["pipeline", "kinds", "shell"])
    assert result.exit_code == 0 and "timeout_s" in result.output and "cmd" in result.output
    assert CliRunner().invoke(app, ["pipeline", "kinds", "shel"]).exit_code == 2


def test_python_dash_m_toolkit_runs_cli():
    out = subprocess.run([sys.executable, "-m", "toolkit", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"cliptk {__version__}"
