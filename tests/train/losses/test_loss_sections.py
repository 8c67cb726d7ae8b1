"""``LossConfig``'s sections (``loss.fastclip``, ``loss.siglip``) and the keys they had before: the flat keys load
with the same meaning from every source (YAML, ``--set``, ``--loss``, dicts), records keep the flat layout so
configs and hashes recorded before the split still match, and a checkpoint written before it resumes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from trainkit import train_cfg, weights

from toolkit.core.config import ConfigError, build, config_hash, load_config, to_dict
from toolkit.train.config import TrainConfig
from toolkit.train.losses.config import LossConfig
from toolkit.train.losses.fastclip.config import FastCLIPConfig
from toolkit.train.losses.siglip.config import SigLIPConfig

FLAT = {"kind": "fastclip", "version": "v2", "gamma_min": 0.3, "tau_min": 0.02, "rho": 7.0, "u_drift": "none",
        "siglip_scale_init": 5.0}
SECTIONED = {"kind": "fastclip", "rho": 7.0, "fastclip": {"version": "v2", "gamma_min": 0.3, "tau_min": 0.02},
             "siglip": {"scale_init": 5.0}}


def test_old_flat_keys_load_into_their_sections_with_the_same_meaning():
    want = LossConfig(kind="fastclip", rho=7.0, fastclip=FastCLIPConfig(version="v2", gamma_min=0.3, tau_min=0.02),
                      siglip=SigLIPConfig(scale_init=5.0))
    assert build(LossConfig, FLAT) == build(LossConfig, SECTIONED) == want
    assert to_dict(want) == to_dict(build(LossConfig, FLAT))  # one record whichever layout was given
    mixed = {"kind": "fastclip", "version": "v2", "fastclip": {"gamma_min": 0.3, "tau_min": 0.02},
             "siglip_scale_init": 5.0, "rho": 7.0}
    assert build(LossConfig, mixed) == want
    siglip = build(LossConfig, {"kind": "siglip", "mode": "gather", "siglip_bias_init": -4.0})
    assert siglip.siglip.bias_init == -4.0 and siglip.init_logit_bias == -4.0


def test_records_keep_the_flat_layout_and_the_hashes_recorded_before_the_split():
    record = to_dict(build(LossConfig, SECTIONED))
    assert "fastclip" not in record and "siglip" not in record and "neuclip" in record  # neuclip: a section already
    assert (record["version"], record["gamma_min"], record["siglip_scale_init"]) == ("v2", 0.3, 5.0)
    # the hashes the code before the split (commit 5de7a0c) recorded for these configs, config_hash(loss, "train")
    recorded = {"01b585aca9e09f2c": {},
                "95704c542ddf0ffd": {"kind": "fastclip", "version": "v2", "tau_min": 0.02, "rho": 7.0},
                "5ab3f4286ab59203": {"kind": "siglip", "mode": "gather", "siglip_scale_init": 5.0,
                                     "siglip_bias_init": -4.0},
                "a534d0a432dc31b7": {"kind": "fastclip", "version": "v3", "u_update": "scent", "scent_gamma": 2.0,
                                     "u_drift": "batch"}}
    for digest, old_keys in recorded.items():
        assert config_hash(build(LossConfig, old_keys), "train") == digest, old_keys


def test_a_key_in_both_layouts_or_in_neither_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"run.yaml: loss.version: given twice: as loss.version .* and as "
                                          r"loss.fastclip.version; keep one"):
        build(LossConfig, {"version": "v2", "fastclip": {"version": "v3"}}, source="run.yaml", prefix="loss")
    with pytest.raises(ConfigError, match=r"loss.gama_min: unknown key; did you mean 'gamma_min'\?"):
        build(LossConfig, {"gama_min": 0.3}, source="run.yaml", prefix="loss")
    with pytest.raises(ConfigError, match=r"loss.fastclip.scale_init: unknown key"):
        build(LossConfig, {"fastclip": {"scale_init": 3.0}}, source="run.yaml", prefix="loss")
    # a bad value is named by the key as it was written
    with pytest.raises(ConfigError, match=r"run.yaml: loss.version: must be one of"):
        build(LossConfig, {"version": "v9"}, source="run.yaml", prefix="loss")
    with pytest.raises(ConfigError, match=r"run.yaml: loss.fastclip.version: must be one of"):
        build(LossConfig, {"fastclip": {"version": "v9"}}, source="run.yaml", prefix="loss")
    with pytest.raises(ConfigError, match=r"loss.siglip_scale_init: must be > 0"):
        build(TrainConfig, {"data": "d", "out": "o", "loss": {"kind": "siglip", "mode": "gather",
                                                              "siglip_scale_init": 0}}, source="run.yaml")


def test_a_later_source_overrides_an_earlier_one_in_either_layout(tmp_path):
    """defaults < YAML < --set < options (the train CLI's --loss sets loss.kind and loss.version) whichever
    layout each source uses; an error names the source that gave the value."""
    old = tmp_path / "old.yaml"
    old.write_text("data: d\nout: o\nloss: {kind: fastclip, version: v2, rho: 6.5, gamma_min: 0.3}\n")
    new = tmp_path / "new.yaml"
    new.write_text("data: d\nout: o\nloss: {kind: fastclip, rho: 6.5, fastclip: {version: v2, gamma_min: 0.3}}\n")
    for path in (old, new):
        assert load_config(TrainConfig, path).loss == load_config(TrainConfig, old).loss
        assert load_config(TrainConfig, path).loss.fastclip.version == "v2"
        for key in ("loss.version", "loss.fastclip.version"):
            cfg = load_config(TrainConfig, path, [f"{key}=v1"])
            assert (cfg.loss.fastclip.version, cfg.loss.fastclip.gamma_min, cfg.loss.rho) == ("v1", 0.3, 6.5)
            cfg = load_config(TrainConfig, path, [f"{key}=v1"], {"loss.kind": "fastclip", "loss.version": "v0"})
            assert cfg.loss.fastclip.version == "v0"
    with pytest.raises(ConfigError, match=r"--set loss.version=v9: loss.fastclip.version: must be one of"):
        load_config(TrainConfig, old, ["loss.version=v9"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: d\nout: o\nloss: {gamma_min: 3}\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: loss.gamma_min: must be <= 1"):
        load_config(TrainConfig, bad)


def test_presets_and_the_default_objective_fill_the_sections():
    base = {"data": "d", "out": "o"}
    cfg = build(TrainConfig, {**base, "preset": "cc3m-v2", "loss": {"fastclip": {"tau_min": 0.02}}})
    assert (cfg.loss.fastclip.version, cfg.loss.fastclip.tau_min, cfg.loss.rho) == ("v2", 0.02, 7.0)
    cfg = build(TrainConfig, {**base, "preset": "cc3m", "loss": {"version": "v1"}})  # flat key over the preset
    assert (cfg.loss.fastclip.version, cfg.loss.fastclip.gamma_decay_epochs) == ("v1", 18)
    drrho = build(TrainConfig, {**base, "epochs": 12, "loss": {"fastclip": {"gamma_rule": "drrho"}}})
    assert drrho.loss.fastclip.gamma_decay_epochs == 12


# The loss section as the code before the split recorded it in trainer.json for the run below (flat keys)
OLD_RECORD = {
    "kind": "fastclip", "version": "v3", "mode": "fastclip", "backend": "auto", "tau_init": 0.07, "learn_tau": True,
    "lr_tau": 2e-4, "lr_tau_schedule": "cosine", "gamma_min": 0.3, "gamma_decay_epochs": 18,
    "gamma_schedule": "cosine", "u_drift": "batch", "rho": 6.5, "eps": 1e-14, "tau_min": 0.01, "tau_max": 1.0,
    "tau_grad_clamp": 5.0, "tau_beta1": 0.9, "tau_beta2": 0.999, "tau_eps": 1e-08,
    "neuclip": {"num_prototypes": 4096, "lr": 0.01, "inner_steps": 10, "restart_every_steps": 500,
                "adagrad_eps": 1e-10, "fit_order": "before"},
    "siglip_scale_init": 10.0, "siglip_bias_init": -10.0}


def _rewrite_as_before_the_split(ckpt) -> None:
    """Make checkpoint folder ``ckpt`` hold what the code before the split wrote: its trainer.json's config with
    the flat loss record and that record's hash, and the manifest's size and sha256 of the new trainer.json."""
    import hashlib

    trainer = json.loads((ckpt / "trainer.json").read_text())
    trainer["config"]["loss"] = OLD_RECORD
    trainer["config_hash"] = config_hash(trainer["config"], "train")  # what the old writer hashed
    data = json.dumps(trainer).encode()
    (ckpt / "trainer.json").write_bytes(data)
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    manifest["files"]["trainer.json"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "checkpoint.json").write_text(json.dumps(manifest))


def test_a_checkpoint_written_with_the_flat_loss_layout_resumes(demo_train, tmp_path):
    from toolkit.train.run import run

    out, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    sectioned = {"kind": "fastclip", "lr_tau": 2e-4, "rho": 6.5,
                 "fastclip": {"version": "v3", "gamma_min": 0.3, "gamma_decay_epochs": 18, "u_drift": "batch"}}
    flat = {k: v for k, v in OLD_RECORD.items() if k != "neuclip"}  # a user's YAML of before, every key flat
    run(train_cfg(demo_train, out, steps=4, loss=sectioned, checkpoint={"every_steps": 2}))
    uninterrupted = weights(out)
    for loss in (flat, sectioned):  # resumed by the old keys and by the new ones
        shutil.rmtree(ckpts / "step-00000004")
        _rewrite_as_before_the_split(ckpts / "step-00000002")
        result = run(train_cfg(demo_train, out, steps=4, loss=loss, checkpoint={"every_steps": 2, "resume": "latest"}))
        assert result.counts["step"] == 4
        for key, value in weights(out).items():
            assert torch.allclose(value, uninterrupted[key], rtol=0, atol=1e-6), key
