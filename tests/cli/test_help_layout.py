"""What `--help` shows a newcomer (issue 43 item 20): every key of `toolkit train` including the nested ones
(optim.*, augment.*, ...), every sub-key in `toolkit pipeline kinds train`, option names whole at 80
columns, and help text taken literally (`[file]` was eaten as rich markup)."""

from __future__ import annotations

import re

import click
import typer
from typer.testing import CliRunner

from toolkit.cli.main import app
from toolkit.cli.options import config_keys
from toolkit.cli.train import FLAGS
from toolkit.train.config import TrainConfig


def _help(args: list[str], width: int = 80) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": str(width)}, terminal_width=width)
    assert result.exit_code == 0, result.output
    return result.output


def _commands(group: click.Command, path: list[str]):
    """(argv path, command) of every command under ``group``, the groups' own help included."""
    yield path, group
    for name, command in getattr(group, "commands", {}).items():  # Typer's groups are not click.Group
        yield from _commands(command, [*path, name])


def test_train_help_names_every_key_without_an_option():
    text = _help(["train"])
    for key, _, shown in config_keys(TrainConfig):
        if shown == "section" or key in FLAGS:
            continue
        head, _, name = key.rpartition(".")
        label = re.escape(f"{head}.* :") if head else "top level:"
        block = re.search(rf"^  {label}(.*?)(?=^  \S|\Z)", text, re.S | re.M)
        assert block is not None and f"{name}={shown}" in " ".join(block.group(1).split()), (key, text)
    assert "augment.* : random_crop=True, scale_min=0.9" in " ".join(text.split())


def test_pipeline_kinds_lists_the_sub_keys_of_each_section():
    result = CliRunner().invoke(app, ["pipeline", "kinds", "train"])
    listed = {line.split()[0] for line in result.output.splitlines() if line.strip()}
    for key in (
        "augment",
        "augment.scale_min",
        "augment.crop_on",
        "optim.warmup_steps",
        "loss.fastclip.gamma_min",
        "launch.timeout_s",
        "eval.feature_cache",
    ):
        assert key in listed, key
    assert {key for key, _, _ in config_keys(TrainConfig)} <= listed


def test_no_option_name_is_cut_at_80_columns():
    root = typer.main.get_command(app)
    ctx = click.Context(root)
    commands = list(_commands(root, []))
    assert len(commands) >= 20 and ["data", "fetch"] in [path for path, _ in commands]
    for path, command in commands:
        text = _help(path)
        assert "…" not in text, (path, text)
        for param in command.get_params(ctx):
            for flag in [*param.opts, *param.secondary_opts]:
                if flag.startswith("--"):
                    assert re.search(rf"(^|[\s,/]){re.escape(flag)}([\s,=]|$)", text, re.M), (
                        path,
                        flag,
                        text,
                    )
        assert max(len(line) for line in text.splitlines()) <= 80, (path, text)


def test_help_text_is_taken_literally():
    text = " ".join(_help(["data", "fetch"], width=200).split())
    assert "e.g. [file] for local test lists" in text, text
