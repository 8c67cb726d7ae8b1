"""The `toolkit` command: help, version, lazy imports, shared options."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
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
    code = (
        "import sys; from toolkit.cli.main import app; "
        "heavy = [m for m in ('torch', 'open_clip', 'webdataset', 'img2dataset', 'numpy') if m in "
        "sys.modules]; "
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# Commands that compute nothing: each must run without importing torch or open_clip (issue 15 item 18:
# `toolkit train presets` took 4.6 s and 825 MB RSS importing both for a table).
LIGHT_COMMANDS = [
    ["train", "presets"],
    ["pipeline", "kinds"],
    ["pipeline", "kinds", "train"],
    ["pipeline", "kinds", "eval.zeroshot"],
    ["pipeline", "validate", "pipelines/quickstart.yaml"],
    ["pipeline", "validate", "pipelines/presets/laion.yaml"],
    ["pipeline", "run", "pipelines/quickstart.yaml", "--dry-run", "--set", "run_dir={tmp}/never"],
    ["train", "--help"],
    ["data", "precompute", "--help"],
    ["eval", "zeroshot", "--help"],
    ["eval", "build-set", "--help"],
]


def test_commands_that_compute_nothing_import_no_torch(tmp_path):
    code = (
        "import json, sys\nfrom typer.testing import CliRunner\nfrom toolkit.cli.main import app\n"
        "heavy = {}\nfor args in json.loads(sys.argv[1]):\n"
        "    result = CliRunner().invoke(app, args)\n"
        "    assert result.exit_code == 0, (args, result.output)\n"
        "    heavy[' '.join(args)] = [m for m in ('torch', 'open_clip') if m in sys.modules]\n"
        "print(json.dumps(heavy))\n"
    )
    commands = [[a.replace("{tmp}", str(tmp_path)) for a in args] for args in LIGHT_COMMANDS]
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(commands)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr[-3000:]
    heavy = json.loads(out.stdout.strip().splitlines()[-1])
    assert {cmd: mods for cmd, mods in heavy.items() if mods} == {}
    assert not (tmp_path / "never").exists()


def test_bad_log_level_and_unknown_command():
    assert CliRunner().invoke(app, ["--log-level", "LOUD", "pipeline", "kinds"]).exit_code == 2
    assert CliRunner().invoke(app, ["nope"]).exit_code == 2


def test_pipeline_kinds_lists_shell_keys():
    result = CliRunner().invoke(app, ["pipeline", "kinds", "shell"])
    assert result.exit_code == 0 and "timeout_s" in result.output and "cmd" in result.output
    assert CliRunner().invoke(app, ["pipeline", "kinds", "shel"]).exit_code == 2


def test_python_dash_m_toolkit_runs_cli():
    out = subprocess.run(
        [sys.executable, "-m", "toolkit", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"cliptk {__version__}"


def test_python_dash_m_toolkit_cli_main_runs_cli():
    out = subprocess.run(
        [sys.executable, "-m", "toolkit.cli.main", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert "Usage:" in out.stdout and "pipeline" in out.stdout


@pytest.mark.parametrize(
    ("args", "source"),
    [
        (
            ["data", "fetch", "--urls", "u.csv", "--out", "o", "--threads", "0"],
            "option --threads: num_threads",
        ),
        (
            ["data", "fetch", "--urls", "u.csv", "--out", "o", "--processes", "0"],
            "option --processes: num_processes",
        ),
        (["data", "fetch", "--urls", "u.csv", "--out", "o", "--timeout", "0"], "option --timeout: timeout_s"),
        (["data", "shard", "--source", "s", "--out", "o", "--threads", "0"], "option --threads: num_threads"),
        (
            ["data", "precompute", "--in", "r", "--out", "t", "--model", "m", "--workers", "-1"],
            "option --workers: num_workers",
        ),
        (["data", "inspect", "d", "--thumb-size", "2"], "option --thumb-size: thumb_size"),
        (
            ["eval", "zeroshot", "-m", "m", "-d", "a", "--root", "r", "-o", "o", "--workers", "-1"],
            "option --workers: num_workers",
        ),
    ],
)
def test_config_errors_name_the_flag_that_was_typed(args, source):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and f"error: {source}: must be" in result.output, result.output


@pytest.mark.parametrize(
    "command",
    [
        ["data", "fetch"],
        ["data", "shard"],
        ["data", "demo"],
        ["data", "precompute"],
        ["data", "inspect", "d"],
        ["eval", "zeroshot"],
        ["eval", "build-set"],
    ],
)
def test_every_config_command_maps_its_options_to_flags(command):
    # load_cli_config raises TypeError for a config key without a same-named parameter before anything
    # else, so reaching the --set error proves every key of this command names a real flag.
    result = CliRunner().invoke(app, [*command, "--set", "no_such_key=1"])
    assert (
        result.exit_code == 2 and "error: --set no_such_key=1: no_such_key: unknown key" in result.output
    ), result.output


@pytest.mark.parametrize(
    ("argv", "hoisted"),
    [
        (["data", "fetch", "--urls", "u", "--quiet"], ["--quiet", "data", "fetch", "--urls", "u"]),
        (
            ["pipeline", "run", "p.yaml", "-q", "--log-level", "DEBUG"],
            ["-q", "--log-level", "DEBUG", "pipeline", "run", "p.yaml"],
        ),
        (["train", "presets", "--log-level=ERROR"], ["--log-level=ERROR", "train", "presets"]),
        (["--quiet", "train", "presets"], ["--quiet", "train", "presets"]),
        (["pipeline", "run", "p.yaml", "--", "-q"], ["pipeline", "run", "p.yaml", "--", "-q"]),
    ],
)
def test_root_options_after_the_subcommand_are_hoisted(argv, hoisted):
    """Issue 15 item 17: `--quiet` worked only before the subcommand."""
    from toolkit.cli.main import hoist_root_options

    assert hoist_root_options(argv) == hoisted


def test_quiet_after_the_subcommand_silences_info_logs(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        f"run_dir: {tmp_path}/run\nstages:\n  - {{name: s, kind: shell, config: {{cmd: 'true'}}}}\n"
    )
    run = [sys.executable, "-m", "toolkit", "pipeline", "run", str(path)]
    loud = subprocess.run(run, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    quiet = subprocess.run(
        [*run, "--quiet", "--from", "s"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert loud.returncode == 0 and quiet.returncode == 0, quiet.stderr
    assert "running" in loud.stderr and "running" not in quiet.stderr and "s: ran" in quiet.stdout


def test_set_help_names_no_key_the_command_lacks():
    """Issue 15 item 19: every command's --set help said `e.g. --set optim.lr=1e-3`."""
    for args in (["data", "shard"], ["eval", "zeroshot"], ["pipeline", "run"]):
        result = CliRunner().invoke(app, [*args, "--help"], terminal_width=200)
        assert result.exit_code == 0 and "optim.lr" not in result.output, args
