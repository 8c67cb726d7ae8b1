"""``LossConfig``'s sections (``loss.fastclip``, ``loss.siglip``, ``loss.neuclip``): one layout read and
written everywhere (YAML, ``--set``, ``--loss``, dicts, records and hashes); the flat keys of records written
before 2026-11-26 are refused naming their new place, in a config and in a checkpoint to resume."""

from __future__ import annotations

import json

import pytest
from trainkit import train_cfg

from toolkit.core.config import ConfigError, build, config_hash, to_dict
from toolkit.core.config_load import load_config
from toolkit.train.config import TrainConfig
from toolkit.train.losses.config import MOVED_KEYS, LossConfig
from toolkit.train.losses.fastclip.config import FastCLIPConfig
from toolkit.train.losses.siglip.config import SigLIPConfig

SECTIONED = {
    "kind": "fastclip",
    "rho": 7.0,
    "fastclip": {"version": "v2", "gamma_min": 0.3, "tau_min": 0.02},
    "siglip": {"scale_init": 5.0},
}


def test_records_are_sectioned_and_read_back_equal():
    cfg = build(LossConfig, SECTIONED)
    assert cfg.fastclip == FastCLIPConfig(version="v2", gamma_min=0.3, tau_min=0.02)
    assert cfg.siglip == SigLIPConfig(scale_init=5.0)
    record = to_dict(cfg)
    assert record["fastclip"]["version"] == "v2" and record["siglip"]["scale_init"] == 5.0
    assert not set(record) & set(MOVED_KEYS)  # no flat key in a record
    assert build(LossConfig, record) == cfg and config_hash(build(LossConfig, record)) == config_hash(cfg)


@pytest.mark.parametrize(
    "flat, new",
    [
        ("version", "loss.fastclip.version"),
        ("gamma_min", "loss.fastclip.gamma_min"),
        ("u_drift", "loss.fastclip.u_drift"),
        ("siglip_scale_init", "loss.siglip.scale_init"),
    ],
)
def test_a_flat_key_is_refused_naming_its_new_place(tmp_path, flat, new):
    value = {"version": "v2", "gamma_min": 0.3, "u_drift": "none", "siglip_scale_init": 5.0}[flat]
    with pytest.raises(ConfigError, match=rf"run.yaml: loss.{flat}: unknown key: it is {new} now"):
        build(
            TrainConfig,
            {"data": "d", "out": "o", "loss": {"kind": "fastclip", flat: value}},
            source="run.yaml",
        )
    old = tmp_path / "old.yaml"
    old.write_text(f"data: d\nout: o\nloss:\n  {flat}: {value}\n")
    with pytest.raises(ConfigError, match=rf"old.yaml: loss.{flat}: unknown key: it is {new} now"):
        load_config(TrainConfig, old)
    with pytest.raises(
        ConfigError, match=rf"--set loss.{flat}=.*: loss.{flat}: unknown key: it is {new} now"
    ):
        load_config(TrainConfig, None, [f"loss.{flat}={value}"], {"data": "d", "out": "o"})


def test_the_cli_loss_name_sets_the_section():
    from toolkit.train.losses.config import dotted, loss_fields

    explicit = {**dotted(loss_fields("fastclip-v1"), "loss."), "data": "d", "out": "o"}
    assert explicit["loss.fastclip.version"] == "v1"
    cfg = load_config(TrainConfig, None, ["loss.fastclip.gamma_min=0.3"], explicit)
    assert (cfg.loss.fastclip.version, cfg.loss.fastclip.gamma_min) == (
        "v1",
        0.3,
    )  # --set's key in the section stays
    assert (
        to_dict(build(TrainConfig, {"data": "d", "out": "o", "preset": "cc3m"}))["loss"]["fastclip"][
            "version"
        ]
        == "v3"
    )


# The loss section as the code before the split recorded it in trainer.json for the run below (flat keys)
OLD_RECORD = {
    "kind": "fastclip",
    "version": "v3",
    "mode": "fastclip",
    "backend": "auto",
    "tau_init": 0.07,
    "learn_tau": True,
    "lr_tau": 2e-4,
    "lr_tau_schedule": "cosine",
    "gamma_min": 0.3,
    "gamma_decay_epochs": 18,
    "gamma_schedule": "cosine",
    "u_drift": "batch",
    "rho": 6.5,
    "eps": 1e-14,
    "tau_min": 0.01,
    "tau_max": 1.0,
    "tau_grad_clamp": 5.0,
    "tau_beta1": 0.9,
    "tau_beta2": 0.999,
    "tau_eps": 1e-08,
    "neuclip": {
        "num_prototypes": 4096,
        "lr": 0.01,
        "inner_steps": 10,
        "restart_every_steps": 500,
        "adagrad_eps": 1e-10,
        "fit_order": "before",
    },
    "siglip_scale_init": 10.0,
    "siglip_bias_init": -10.0,
}


def _rewrite_as_before_the_split(ckpt) -> None:
    """Make checkpoint folder ``ckpt`` hold what the code before the split wrote: its trainer.json's config
    with the flat loss record and that record's hash, and the manifest's size and sha256 of the new
    trainer.json."""
    import hashlib

    trainer = json.loads((ckpt / "trainer.json").read_text())
    trainer["config"]["loss"] = OLD_RECORD
    trainer["config_hash"] = config_hash(trainer["config"], "train")  # what the old writer hashed
    data = json.dumps(trainer).encode()
    (ckpt / "trainer.json").write_bytes(data)
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    manifest["files"]["trainer.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))


def test_a_checkpoint_recorded_in_the_flat_layout_is_refused_naming_each_key(demo_train, tmp_path):
    """An old run folder's checkpoint is not resumed under another reading of its keys: the refusal names the
    flat keys and their new places, and how to start from its weights; with --init the weights still load."""
    from toolkit.train.run import run

    out, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    sectioned = {
        "kind": "fastclip",
        "lr_tau": 2e-4,
        "rho": 6.5,
        "fastclip": {"version": "v3", "gamma_min": 0.3, "gamma_decay_epochs": 18, "u_drift": "batch"},
    }
    run(train_cfg(demo_train, out, steps=2, loss=sectioned, checkpoint={"every_steps": 2}))
    _rewrite_as_before_the_split(ckpts / "step-00000002")
    again = train_cfg(
        demo_train, out, steps=4, loss=sectioned, checkpoint={"every_steps": 2, "resume": "latest"}
    )
    with pytest.raises(
        ValueError,
        match=r"step-00000002: recorded in the flat loss layout of before 2026-11-26 "
        r"\(loss.version is loss.fastclip.version now, .*loss.siglip_scale_init is "
        r"loss.siglip.scale_init now.*--init",
    ):
        run(again)
    fresh = train_cfg(
        demo_train, tmp_path / "fresh", steps=1, loss=sectioned, init=str(ckpts / "step-00000002")
    )
    assert run(fresh).counts["step"] == 1
