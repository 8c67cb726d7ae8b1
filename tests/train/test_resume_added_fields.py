"""A checkpoint recorded before a config field existed still resumes when the run uses what the field's
absence meant (``option(absent_means=...)``), and is refused, naming the key, when it does not."""

from __future__ import annotations

import pytest
from trainkit import train_cfg

from toolkit.train.checkpoint.resume import ConfigMismatch, check_config, output_config

# the fields added to TrainConfig after checkpoints recorded their config, and what their absence meant
ADDED = {
    "lock_image": False,
    "lock_image_unlocked_groups": 0,
    "lock_text": False,
    "lock_text_unlocked_layers": 0,
    "ema_decay": 0.0,
}


def _old_record(cfg) -> dict:
    """trainer.json as written before the added fields: their keys absent, the hash of another layout."""
    config = {k: v for k, v in output_config(cfg).items() if k not in ADDED and k != "augment"}
    return {"config_hash": "0123456789abcdef", "config": config}


def test_a_record_without_the_added_fields_resumes_when_the_run_keeps_the_old_behaviour(demo_train, tmp_path):
    cfg = train_cfg(demo_train, tmp_path / "run", augment={"random_crop": False})
    check_config("ckpt", _old_record(cfg), cfg)


@pytest.mark.parametrize(
    "over, key",
    [({"ema_decay": 0.5}, "ema_decay"), ({"lock_text": True}, "lock_text"), ({}, "augment.random_crop")],
)
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


def _features_set(demo_train, dst):
    """demo_train's token ids with frozen-tower image features (float16 [32], random: the check reads no
    values) instead of pixels, written by the precompute's shard writer."""
    import dataclasses

    import numpy as np

    from toolkit.core import files
    from toolkit.data.trainset.format import DATASET_JSON, Field, TrainDataset
    from toolkit.data.trainset.loader import make_reader
    from toolkit.data.trainset.writer import TrainShardWriter

    ds = TrainDataset.open(str(demo_train))
    reader = make_reader(ds)
    tokens = reader.read(np.arange(ds.num_samples, dtype=np.int64))["tokens"]
    reader.close()
    fields = [Field("image_features", "img_feat.f16", "float16", (32,)), ds.field("tokens")]
    features = np.random.default_rng(0).standard_normal((ds.num_samples, 32)).astype(np.float16)
    dst.mkdir(parents=True)
    writer = TrainShardWriter(str(dst), fields, ds.samples_per_shard)
    for i in range(ds.num_samples):
        writer.add(i, [features[i].tobytes(), tokens[i].astype(np.int32).tobytes()], {})
    out = dataclasses.replace(ds, fields=fields, shards=writer.close(), root=str(dst))
    files.write_json_atomic(str(dst / DATASET_JSON), out.to_json())
    return dst


def test_augment_changes_nothing_on_frozen_tower_features(demo_train, tmp_path):
    """A LiT run recorded before ``augment`` existed resumes with the augment defaults (random crops on):
    its data holds image features, with no pixels to crop. Another change is still refused, alone named."""
    data = _features_set(demo_train, tmp_path / "features")
    cfg = train_cfg(data, tmp_path / "run")
    assert cfg.augment.random_crop
    check_config("ckpt", _old_record(cfg), cfg)
    record = _old_record(cfg)
    record["config"] = {**record["config"], "seed": cfg.seed + 1}
    with pytest.raises(ConfigMismatch) as err:
        check_config("ckpt", record, cfg)
    assert [c[0] for c in err.value.changes] == ["seed"]
    pixels = train_cfg(demo_train, tmp_path / "run")
    with pytest.raises(ConfigMismatch) as err:  # on pixels the crop changes training
        check_config("ckpt", _old_record(pixels), pixels)
    assert [c[0] for c in err.value.changes] == ["augment.random_crop"]
