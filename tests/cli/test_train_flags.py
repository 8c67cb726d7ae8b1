"""``toolkit train``'s options come from the config fields they set (cli/options.config_parameters): one
source for type, default and help, and a flag whose field drifts away fails here, not at run time."""

from __future__ import annotations

import dataclasses

import pytest
import typer

from toolkit.cli import train as train_cli
from toolkit.cli.options import config_field, config_parameters
from toolkit.train.config import TrainConfig


def _options() -> dict:
    command = typer.main.get_command(train_cli.app)
    return {p.name: p for p in command.params if p.param_type_name == "option"}


def test_every_flag_sets_an_existing_field_with_its_doc_and_default():
    options = _options()
    for key, flags in train_cli.FLAGS.items():
        field, _ = config_field(TrainConfig, key)
        option = options[key.replace(".", "_")]
        names = {name for decl in flags for name in decl.split("/")}  # a switch: "--x/--no-x"
        assert names <= set(option.opts) | set(option.secondary_opts), (key, option.opts)
        assert option.help.startswith(field.metadata["doc"].rstrip()), key
        if field.default is not dataclasses.MISSING and field.default != "":
            assert f"(default: {field.default})" in option.help, (key, option.help)


def test_help_shows_the_fields_defaults_not_copies():
    options = _options()
    assert "(default: 64)" in options["batch_size"].help  # TrainConfig.batch_size
    assert "(default: 0.001)" in options["optim_lr"].help  # OptimConfig.lr
    assert "(required)" in options["data"].help
    assert "fastclip-v3" in options["loss"].help and "openclip" in options["loss"].help


def test_a_planted_drift_fails_when_the_options_are_built():
    drifted = {**train_cli.FLAGS, "optim.learning_rate": ("--lr",)}  # a field renamed in optim.py
    with pytest.raises(TypeError, match="optim.learning_rate"):
        config_parameters(TrainConfig, drifted)
    with pytest.raises(TypeError, match="batch_sise"):
        config_parameters(TrainConfig, {"batch_sise": ("--batch-size",)})
