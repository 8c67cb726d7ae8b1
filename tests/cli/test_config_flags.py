"""Every command's options against the config fields they set (cli/options.ConfigOptions): `data`, `eval`
and `plan` get one option per field of their stage config, typed and documented by the field; a field added
to a config becomes an option; a flag naming a field that does not exist fails. `train` is checked by
test_train_flags.py. Also the root help: no value shown for flags, and every objective named."""

from __future__ import annotations

import dataclasses
import sys
import types
from dataclasses import dataclass

import click
import pytest
import typer
from typer.testing import CliRunner

from toolkit.cli import data as data_cli
from toolkit.cli import eval as eval_cli
from toolkit.cli import plan as plan_cli
from toolkit.cli.main import app
from toolkit.cli.options import ConfigOptions, config_command, config_field
from toolkit.core.config import option

GROUPS = {"data": data_cli.COMMANDS, "eval": eval_cli.COMMANDS, "plan": plan_cli.COMMANDS}


def _command(path: list[str]) -> click.Command:
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return command


def _options(command: click.Command) -> dict[str, click.Option]:
    return {p.name: p for p in command.get_params(click.Context(command)) if p.param_type_name == "option"}


CASES = [(group, name) for group, commands in GROUPS.items() for name in commands]


@pytest.mark.parametrize(("group", "name"), CASES, ids=[f"{g} {n}" for g, n in CASES])
def test_every_config_field_is_an_option_with_its_doc_and_default(group, name):
    spec = GROUPS[group][name]
    command = _command([group] if group == name else [group, name])
    options, cls = _options(command), spec.cls()
    fields = {
        f.name for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(config_field(cls, f.name)[1])
    } - set(spec.exclude)
    assert fields and fields <= set(options), sorted(fields - set(options))
    for key, flags in spec.all_flags().items():
        field, _ = config_field(cls, key)
        opt = options[key.replace(".", "_")]  # a nested field's option is named by its dotted key
        assert flags[0].split("/")[0] in opt.opts, (key, opt.opts)
        assert opt.help.startswith(field.metadata["doc"].rstrip()), key
        if field.default is not dataclasses.MISSING and field.default not in ("", None):
            assert f"(default: {field.default})" in opt.help, (key, opt.help)


def test_eval_workers_shows_the_configs_default():
    from toolkit.eval.zeroshot import ZeroShotConfig

    workers = _options(_command(["eval", "zeroshot"]))["num_workers"]
    assert "--workers" in workers.opts
    assert f"(default: {ZeroShotConfig.__dataclass_fields__['num_workers'].default})" in workers.help


def test_a_flag_for_a_missing_field_fails():
    drifted = ConfigOptions("toolkit.train.plan.config:PlanConfig", flags={"batchsize": ("-b",)})
    with pytest.raises(TypeError, match="batchsize"):
        drifted.all_flags()


@dataclass(frozen=True)
class _StageConfig:
    out: str = option(doc="Where to write.")
    num_rounds: int = option(3, ge=1, doc="Rounds.")
    sizes: list[int] = option(factory=lambda: [1, 2], doc="Sizes.")
    fast: bool = option(False, doc="Go fast.")


def test_a_new_field_becomes_an_option_and_reaches_the_config(monkeypatch):
    """A stage config in a module of its own: every field is an option without a line of CLI code;
    values (lists split into ints, flags) arrive in the built config; bad list items name the flag."""
    module = types.ModuleType("cliptk_test_stage")
    module.StageConfig = _StageConfig
    monkeypatch.setitem(sys.modules, module.__name__, module)
    spec = ConfigOptions("cliptk_test_stage:StageConfig")
    stage = typer.Typer()
    seen = {}

    @stage.command("go", cls=config_command(spec))
    def go(ctx: typer.Context) -> None:
        from toolkit.cli.common import load_cli_config

        seen["cfg"] = load_cli_config(ctx, _StageConfig, None, None, **spec.values(ctx))

    @stage.command("other")
    def other() -> None:
        pass

    result = CliRunner().invoke(stage, ["go", "--out", "o", "--num-rounds", "5", "--sizes", "4, 8", "--fast"])
    assert result.exit_code == 0, result.output
    assert seen["cfg"] == _StageConfig(out="o", num_rounds=5, sizes=[4, 8], fast=True)
    result = CliRunner().invoke(stage, ["go", "--out", "o"])
    assert result.exit_code == 0 and seen["cfg"] == _StageConfig(out="o")
    bad = CliRunner().invoke(stage, ["go", "--out", "o", "--sizes", "4,x"])
    assert bad.exit_code == 2 and "option --sizes" in bad.output
    help_text = CliRunner().invoke(stage, ["go", "--help"]).output
    assert "--num-rounds" in help_text and "(default: 3)" in help_text and "--no-fast" in help_text
    off = CliRunner().invoke(stage, ["go", "--out", "o", "--no-fast"])
    assert off.exit_code == 0 and not seen["cfg"].fast


def test_root_help_shows_no_value_for_flags_and_names_every_objective():
    from toolkit.train.losses.registry import specs

    out = CliRunner().invoke(app, ["--help"], terminal_width=200).output
    for flag in ("--version", "--quiet"):
        (line,) = [row for row in out.splitlines() if f"{flag} " in row]
        assert "<bool>" not in line, line
    described = " ".join(out.split()).lower()
    for kind in specs():
        assert kind in described, kind
