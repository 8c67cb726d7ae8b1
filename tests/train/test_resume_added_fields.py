"""A checkpoint recorded before a config field existed still resumes when the run uses what the field's
absence meant (``option(absent_means=...)``), and is refused, naming the key, when it does not."""

from __future__ import annotations

import pytest
from trainkit import train_cfg

from toolkit.train.checkpoint.resume import ConfigMismatch, check_config, output_config

# the fields added to TrainConfig after checkpoints recorded their config, and what their absence meant
ADDED = {"lock_image": False, "lock_image_unlocked_groups": 0, "lock_text": False,
         "lock_text_unlocked_layers": 0, "ema_decay": 0.0}


def _old_record(cfg) -> dict:
    """trainer.json as written before the added fields: their keys absent, the hash of another layout."""
    config = {k: v for k, v in output_config(cfg).items() if k not in ADDED and k != "augment"}
    return {"config_hash": "0123456789abcdef", "config": config}


def test_a_record_without_the_added_fields_resumes_when_the_run_keeps_the_old_behaviour(demo_train, tmp_path):
    cfg = train_cfg(demo_train, tmp_path / "run", augment={"random_crop": False})
    check_config("ckpt", _old_record(cfg), cfg)


@pytest.mark.parametrize("over, key", [({"ema_decay": 0.5}, "ema_decay"), ({"lock_text": True}, "lock_text"),
                                       ({}, "augment.random_crop")])
def test_a_record_without_the_added_fields_is_refused_naming_a_changed_one(demo_train, tmp_path, over, key):
    base = train_cfg(demo_train, tmp_path / "run", augment={"random_crop": False})
    cfg = train_cfg(demo_train, tmp_path / "run", **{"augment": {"random_crop": "augment" in key}, **over})
    with pytest.raises(ConfigMismatch, match=key.replace(".", r"\.")) as err:
        check_config("ckpt", _old_record(base), cfg)
    assert [c[0] for c in err.value.changes] == [key]


def test_a_record_that_differs_elsewhere_is_still_refused(demo_train, tmp_path):
    cfg = train_cfg(demo_train, tmp_path / "run", augment={"random_crop": False})
    record = _old_record(cfg)
    record["config"] = {**record["config"], "seed": cfg.seed + 1}
    with pytest.raises(ConfigMismatch, match="seed"):
        check_config("ckpt", record, cfg)
