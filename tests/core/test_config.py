"""Config loader: precedence, and errors that name the source and the key path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest

from toolkit.core.config import ConfigError, config_hash, input_paths, option, to_dict
from toolkit.core.config_load import load_config


@dataclass(frozen=True)
class OptimConfig:
    lr: float = option(1e-3, gt=0, doc="Peak learning rate.")
    name: Literal["adamw", "lamb", "lion", "sgd"] = option("adamw", doc="Optimizer.")
    betas: tuple[float, ...] = option((0.9, 0.98), doc="Adam betas.")


@dataclass(frozen=True)
class RunConfig:
    data: str = option(doc="Training shards.", is_input=True)
    num_steps: int = option(100, ge=1, doc="Optimizer steps.")
    num_workers: int = option(2, ge=0, doc="Loader workers.", affects_output=False)
    tag: str | None = option(None, doc="Free-form tag.")
    optim: OptimConfig = option(factory=OptimConfig, doc="Optimizer settings.")
    extra: dict[str, int] = option(factory=dict, doc="Counts by name.")


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_precedence_defaults_yaml_set_explicit(tmp_path):
    path = write(tmp_path, "data: shards\nnum_steps: 7\noptim: {lr: 2e-3}\n")
    cfg = load_config(RunConfig, path)
    assert (cfg.num_steps, cfg.optim.lr, cfg.optim.name) == (7, 2e-3, "adamw")
    cfg = load_config(RunConfig, path, ["num_steps=9", "optim.name=lion", "optim.betas=[0.9, 0.99]"])
    assert (cfg.num_steps, cfg.optim.name, cfg.optim.betas) == (9, "lion", (0.9, 0.99))
    cfg = load_config(RunConfig, path, ["num_steps=9"], {"num_steps": 11, "optim.lr": None})
    assert cfg.num_steps == 11 and cfg.optim.lr == 2e-3


def test_explicit_value_errors_name_the_given_source(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, None, ["data=x"], {"num_steps": 0}, {"num_steps": "option --steps"})
    assert err.value.source == "option --steps" and err.value.key == "num_steps"
    with pytest.raises(ConfigError) as err:  # no source given: nothing pretends to know the flag
        load_config(RunConfig, None, ["data=x"], {"num_steps": 0})
    assert err.value.source == "explicit value"


def test_unknown_key_names_file_key_and_suggestion(tmp_path):
    path = write(tmp_path, "data: x\noptim: {lerning_rate: 1}\n")
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, path)
    assert str(path) in str(err.value) and "optim.lerning_rate" in str(err.value)
    path = write(tmp_path, "data: x\nnum_step: 3\n")
    with pytest.raises(ConfigError, match="did you mean 'num_steps'"):
        load_config(RunConfig, path)


@pytest.mark.parametrize(
    ("override", "key", "words"),
    [
        ("num_steps=abc", "num_steps", "expected an integer"),
        ("num_steps=0", "num_steps", "must be >= 1"),
        ("optim.lr=-1", "optim.lr", "must be > 0"),
        ("optim.name=adam", "optim.name", "did you mean 'adamw'"),
        ("optim.betas=0.9", "optim.betas", "expected a list"),
        ("extra.a=x", "extra.a", "expected an integer"),
        ("optim.nope=1", "optim.nope", "unknown key"),
    ],
)
def test_bad_override_names_set_and_key(tmp_path, override, key, words):
    path = write(tmp_path, "data: x\n")
    with pytest.raises(ConfigError) as err:
        load_config(RunConfig, path, [override])
    assert err.value.source == f"--set {override}" and err.value.key == key and words in err.value.message


def test_missing_required_and_wrong_type_in_file(tmp_path):
    with pytest.raises(ConfigError, match="data: missing required value"):
        load_config(RunConfig, write(tmp_path, "num_steps: 3\n"))
    with pytest.raises(ConfigError, match=r"tag: expected str \| None, got \[1\]"):
        load_config(RunConfig, write(tmp_path, "data: x\ntag: [1]\n"))
    with pytest.raises(ConfigError, match="expected a mapping at the top level"):
        load_config(RunConfig, write(tmp_path, "- 1\n"))
    with pytest.raises(ConfigError, match="file not found"):
        load_config(RunConfig, tmp_path / "absent.yaml")


def test_hash_stable_and_ignores_fields_that_do_not_affect_output():
    a = load_config(RunConfig, None, ["data=x"])
    b = load_config(RunConfig, None, ["data=x", "num_workers=7"])
    c = load_config(RunConfig, None, ["data=x", "num_steps=5"])
    assert config_hash(a) == config_hash(b) != config_hash(c)
    assert len(config_hash(a)) == 16 and config_hash(a) == config_hash(
        load_config(RunConfig, None, ["data=x"])
    )
    assert to_dict(a)["optim"] == {"lr": 1e-3, "name": "adamw", "betas": [0.9, 0.98]}
    assert input_paths(a) == {"data": "x"}


@dataclass(frozen=True)
class LaterRunConfig:
    """RunConfig's fields plus one added after runs recorded RunConfig (omit_at_default)."""

    data: str = option(doc="Training shards.", is_input=True)
    num_steps: int = option(100, ge=1, doc="Optimizer steps.")
    num_workers: int = option(2, ge=0, doc="Loader workers.", affects_output=False)
    tag: str | None = option(None, doc="Free-form tag.")
    optim: OptimConfig = option(factory=OptimConfig, doc="Optimizer settings.")
    extra: dict[str, int] = option(factory=dict, doc="Counts by name.")
    rule: Literal["old", "new"] = option("old", doc="Added later.", omit_at_default=True)


def test_a_field_added_later_leaves_old_records_and_hashes_valid_at_its_default():
    old = load_config(RunConfig, None, ["data=x", "num_steps=7"])
    same = load_config(LaterRunConfig, None, ["data=x", "num_steps=7"])
    assert to_dict(same) == to_dict(old) and config_hash(same) == config_hash(old)
    changed = load_config(LaterRunConfig, None, ["data=x", "num_steps=7", "rule=new"])
    assert to_dict(changed) == {**to_dict(old), "rule": "new"}
    assert config_hash(changed) != config_hash(old)
    assert load_config(LaterRunConfig, None, explicit=to_dict(changed)) == changed  # the record rebuilds it
