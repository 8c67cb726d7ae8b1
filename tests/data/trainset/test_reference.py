"""precompute --reference-model: a reference model's normalised embeddings stored per sample in every storage
mode, equal to open_clip running that model on the raw pairs; checked reads, verify/inspect, world-size-free
batches, 2 gloo ranks writing the same bytes as one process, and the refusals."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from datakit import MODEL, good_samples, precompute, read_meta, read_tar, write_raw_shard
from PIL import Image
from typer.testing import CliRunner

from toolkit.cli.main import app
from toolkit.data.trainset.format import TrainDataset
from toolkit.data.trainset.loader import make_loader
from toolkit.data.trainset.precompute import worker as precompute_worker

MODES = ("pixels", "jpeg", "index")
ROOT = Path(__file__).resolve().parents[3]
KEYS = ("ref_image", "ref_text", "index")


def _save_reference(folder: Path, embed_dim: int, seed: int) -> Path:
    """A random-init tiny reference saved as a model folder, unlike the student (cliptk-tiny, 32 px, OpenAI
    mean/std): 40 px, its own mean/std, width ``embed_dim``."""
    from toolkit.models import build_model, model_config, save_model
    from toolkit.models.weights import default_preprocess_cfg

    cfg = dict(model_config(MODEL), embed_dim=embed_dim)
    cfg["vision_cfg"] = dict(cfg["vision_cfg"], image_size=40)
    torch.manual_seed(seed)
    preprocess = {**default_preprocess_cfg(cfg), "mean": [0.5, 0.4, 0.3], "std": [0.2, 0.25, 0.3]}
    return save_model(build_model(cfg), cfg, folder, preprocess_cfg=preprocess)


@pytest.fixture(scope="module")
def ref_dir(tmp_path_factory) -> Path:
    return _save_reference(tmp_path_factory.mktemp("reference") / "model", 48, seed=3)


@pytest.fixture(scope="module")
def ref_sets(small_raw, ref_dir, tmp_path_factory) -> dict[str, Path]:
    """small_raw (103 samples, 5 raw shards) with the reference, in every mode, parts of 10."""
    root = tmp_path_factory.mktemp("ref_modes")
    shutil.copytree(small_raw, root / "raw")
    for mode in MODES:
        precompute(
            root / "raw",
            root / mode,
            num_workers=2,
            samples_per_shard=10,
            storage=mode,
            reference_model=str(ref_dir),
        )
    return {m: root / m for m in MODES}


def _all(path: Path, **kw) -> dict[str, np.ndarray]:
    batches = list(make_loader(str(path), batch_size=16, shuffle=False, **kw))
    return {k: np.concatenate([b[k].numpy() for b in batches]) for k in KEYS}


def _oracle(ref_dir: Path, raw: Path, meta: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """open_clip itself on the raw pairs: its local-dir loader, transform and tokenizer (float32 [n, d])."""
    import open_clip

    model, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{ref_dir}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{ref_dir}")
    shards = {name: read_tar(raw / name) for name in {m["source"] for m in meta}}
    images = torch.stack(
        [
            preprocess(Image.open(io.BytesIO(shards[m["source"]][m["key"]]["jpg"])).convert("RGB"))
            for m in meta
        ]
    )
    with torch.no_grad():
        x = torch.nn.functional.normalize(model.eval().encode_image(images), dim=-1)
        y = torch.nn.functional.normalize(model.encode_text(tokenizer([m["caption"] for m in meta])), dim=-1)
    return x.numpy(), y.numpy()


def test_embeddings_equal_open_clip_on_the_raw_pairs_in_every_mode(ref_sets, ref_dir):
    got = {m: _all(ref_sets[m]) for m in MODES}
    meta = read_meta(ref_sets["pixels"])
    x, y = _oracle(ref_dir, ref_sets["pixels"].parent / "raw", meta)
    for mode in MODES:  # from the raw bytes in every mode (not jpeg's re-encoded copy): the same bytes
        assert (got[mode]["index"] == np.arange(103)).all()
        assert got[mode]["ref_image"].dtype == np.float16 and got[mode]["ref_image"].shape == (103, 48)
        for key in ("ref_image", "ref_text"):
            assert (got[mode][key] == got["pixels"][key]).all(), (mode, key)
    # float16 storage: within half an ulp of values below 1 (2^-12), plus float32 batch-order noise
    np.testing.assert_allclose(got["pixels"]["ref_image"].astype(np.float32), x, rtol=0, atol=5e-4)
    np.testing.assert_allclose(got["pixels"]["ref_text"].astype(np.float32), y, rtol=0, atol=5e-4)
    norms = np.linalg.norm(got["pixels"]["ref_image"].astype(np.float32), axis=1)
    assert np.allclose(norms, 1, atol=2e-3)
    for mode in MODES:  # the pass's cost is in the manifest
        assert (
            json.loads((ref_sets[mode] / "manifest.json").read_text())["details"]["throughput"]["reference_s"]
            > 0
        )
    info = TrainDataset.open(str(ref_sets["index"])).extra["reference"]
    assert (
        info["dim"] == 48
        and info["preprocess"]["size"] == 40
        and info["preprocess"]["mean"] == [0.5, 0.4, 0.3]
    )
    assert (
        info["weights_sha256"]
        == hashlib.sha256((ref_dir / "open_clip_model.safetensors").read_bytes()).hexdigest()
    )


@pytest.mark.parametrize("mode", MODES)
def test_ranks_see_the_single_process_reference_rows_and_resume_at_another_world_size(ref_sets, mode):
    path = str(ref_sets[mode])

    def steps(rank: int, ws: int, start: int, workers: int = 0) -> list[dict]:
        loader = make_loader(
            path,
            batch_size=8,
            rank=rank,
            world_size=ws,
            seed=3,
            start_step=start,
            num_steps=3,
            num_workers=workers,
        )
        return [{k: b[k].numpy() for k in KEYS} for b in loader]

    one = steps(0, 1, 0) + steps(0, 1, 3)
    ranks = [steps(r, 2, 0) for r in range(2)]
    resumed = [steps(r, 4, 3, workers=2 if r == 0 else 0) for r in range(4)]  # resume at step 3 on 4 ranks
    for t in range(6):
        parts = [ranks[r][t] for r in range(2)] if t < 3 else [resumed[r][t - 3] for r in range(4)]
        for k in KEYS:
            assert (np.concatenate([p[k] for p in parts]) == one[t][k]).all(), (t, k)
    by_id = _all(ref_sets[mode])
    for batch in one:  # each row is its own sample's, whatever the order
        assert (batch["ref_text"] == by_id["ref_text"][batch["index"]]).all()


def test_reads_straight_into_batch_order_equal_the_portable_path_with_float16_fields(ref_sets):
    """Four fields a sample (uint8, int32, two float16): toolkit.data.trainset.scatter's batches equal the
    read-and-gather path's, dtype, shape and contiguity included, for a shuffled order and in order."""
    from toolkit.data.trainset.loader import InOrder
    from toolkit.data.trainset.order import BatchOrder
    from toolkit.data.trainset.storage.pixels import SampleReader

    ds = TrainDataset.open(str(ref_sets["pixels"]))
    scatter, portable = SampleReader(ds, scatter=True), SampleReader(ds, scatter=False)
    for order in (BatchOrder(103, 16, seed=9), InOrder(103, 40, 0)):
        for t in range(8):
            got, want = scatter.read(order.batch_ids(t)), portable.read(order.batch_ids(t))
            assert list(got) == list(want) == ["image", "tokens", "ref_image", "ref_text"]
            for role, array in want.items():
                assert got[role].dtype == array.dtype and got[role].flags.c_contiguous
                np.testing.assert_array_equal(got[role], array)
    scatter.close()
    portable.close()


def test_frozen_tower_features_and_a_reference_together(ref_sets, ref_dir, tmp_path):
    """LiT data (frozen-tower features instead of pixels and tokens) with a reference: four fields per sample,
    the reference rows equal to the pixels set's (both from the raw pairs)."""
    out = tmp_path / "lit"
    precompute(
        ref_sets["pixels"].parent / "raw",
        out,
        num_workers=2,
        samples_per_shard=10,
        image_tower="open_clip",
        image_tower_model=MODEL,
        text_tower="open_clip",
        text_tower_model=MODEL,
        reference_model=str(ref_dir),
    )
    assert [f.role for f in TrainDataset.open(str(out)).fields] == [
        "image_features",
        "text_features",
        "ref_image",
        "ref_text",
    ]
    batch = next(iter(make_loader(str(out), batch_size=103, shuffle=False)))
    assert batch["image_features"].shape == (103, 128) and batch["text_features"].shape == (103, 128)
    want = _all(ref_sets["pixels"])
    assert (batch["ref_image"].numpy() == want["ref_image"]).all() and (
        batch["ref_text"].numpy() == want["ref_text"]
    ).all()


def test_a_model_name_with_a_weights_file_equals_its_folder(tmp_path):
    from toolkit.models import load_model, save_model

    raw = tmp_path / "raw"
    raw.mkdir()
    write_raw_shard(raw / "00000.tar", good_samples(np.random.default_rng(1), "n", 6))
    folder = save_model(load_model(MODEL, seed=2).model, load_model(MODEL).model_cfg, tmp_path / "tiny")
    precompute(raw, tmp_path / "a", reference_model=str(folder), num_workers=1)
    precompute(
        raw,
        tmp_path / "b",
        reference_model=MODEL,
        num_workers=1,
        reference_weights=str(folder / "open_clip_model.safetensors"),
    )
    res = CliRunner().invoke(
        app,
        [
            "data",
            "precompute",
            "--in",
            str(raw),
            "--out",
            str(tmp_path / "c"),
            "--model",
            MODEL,
            "--reference-model",
            str(folder),
            "--workers",
            "1",
        ],
        env={"COLUMNS": "300"},
    )
    assert (
        res.exit_code == 0 and "reference pass: " in res.output and "s per 1,000 samples read" in res.output
    )
    a, b = _all(tmp_path / "a"), _all(tmp_path / "c")
    assert (a["ref_image"] == b["ref_image"]).all() and (a["ref_text"] == b["ref_text"]).all()
    b = _all(tmp_path / "b")  # the name + weights file
    assert (a["ref_image"] == b["ref_image"]).all() and (a["ref_text"] == b["ref_text"]).all()
    assert a["ref_image"].shape == (6, 128)


def test_the_reference_weights_are_hashed_once_from_a_checkpoint_or_a_plain_folder(
    ref_dir, tmp_path, monkeypatch
):
    """A training checkpoint's weights are hashed by load_model's checkpoint.json check; load_reference
    takes that digest instead of reading the file a second time (a folder without a manifest: once, by
    load_reference). Counted by a wrapper around the one file_sha256 both call."""
    from toolkit.core import files
    from toolkit.data.trainset.reference import load_reference
    from toolkit.models import trust
    from toolkit.models.weights import WEIGHTS_NAME
    from toolkit.train.checkpoint import format as ckpt

    blobs = {p.name: p.read_bytes() for p in ref_dir.iterdir()}
    step_dir = Path(ckpt.write_blobs(str(tmp_path / "checkpoints"), 7, blobs, 1))
    digest = hashlib.sha256(blobs[WEIGHTS_NAME]).hexdigest()
    hashed, real = [], files.file_sha256

    def counting(path, *args, **kwargs):
        hashed.append(Path(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(files, "file_sha256", counting)
    monkeypatch.setattr(trust, "file_sha256", counting)
    for folder in (step_dir, ref_dir):
        hashed.clear()
        assert load_reference(str(folder)).sha256 == digest
        assert hashed.count(folder / WEIGHTS_NAME) == 1, (folder, hashed)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"reference_model": "no-such-model", "reference_weights": "x.safetensors"},
            "unknown model 'no-such-model'",
        ),
        ({"reference_model": MODEL}, "needs reference_weights, a local weights file"),
        (
            {"reference_model": MODEL, "reference_weights": "/nowhere/w.safetensors"},
            "weights file not found: /nowhere/w.safetensors",
        ),
        ({"reference_model": "/nowhere/model-folder"}, "/nowhere/model-folder"),
        ({"reference_weights": "/nowhere/w.safetensors"}, "reference_weights: given without reference_model"),
        (
            {"reference_model": "ViT-B-32", "reference_weights": "openai"},
            "'openai' is not a local file; a reference",
        ),
    ],
)
def test_refusals_name_what_is_wrong(small_raw, tmp_path, options, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        precompute(small_raw, tmp_path / "out", num_workers=1, **options)


def test_the_cli_flags_and_a_missing_weights_file(small_raw, tmp_path):
    res = CliRunner().invoke(
        app,
        [
            "data",
            "precompute",
            "--in",
            str(small_raw),
            "--out",
            str(tmp_path / "o"),
            "--model",
            MODEL,
            "--reference-model",
            MODEL,
            "--reference-weights",
            str(tmp_path / "missing.safetensors"),
        ],
        env={"COLUMNS": "300"},
    )
    assert res.exit_code != 0 and f"{tmp_path / 'missing.safetensors'}" in res.output
    helptext = CliRunner().invoke(app, ["data", "precompute", "--help"], env={"COLUMNS": "300"}).output
    assert "--reference-model" in helptext and "--reference-weights" in helptext


def test_a_reference_changed_in_place_is_refused_on_resume(tmp_path, monkeypatch):
    """Another --reference-model starts afresh like any option; the same folder with other weights is
    refused."""
    raw = tmp_path / "raw"
    raw.mkdir()
    rng = np.random.default_rng(5)
    for i in range(3):
        write_raw_shard(raw / f"{i:05d}.tar", good_samples(rng, f"r{i}_", 4))
    first, other = (
        _save_reference(tmp_path / "ref", 48, seed=1),
        _save_reference(tmp_path / "ref2", 64, seed=1),
    )
    real = precompute_worker.process_shard

    def failing(job, task, on_read):
        if task.index == 2:
            raise OSError("disk trouble")
        return real(job, task, on_read)

    monkeypatch.setattr(precompute_worker, "process_shard", failing)
    with pytest.raises(OSError, match="disk trouble"):
        precompute(raw, tmp_path / "out", num_workers=1, reference_model=str(first))
    with pytest.raises(
        OSError, match="disk trouble"
    ):  # another option value: the old rows are dropped, no refusal
        precompute(raw, tmp_path / "out", num_workers=1, reference_model=str(other))
    monkeypatch.setattr(precompute_worker, "process_shard", real)
    _save_reference(tmp_path / "ref2", 48, seed=2)  # the same folder, retrained narrower
    with pytest.raises(ValueError, match="reference model of d_ref 64.*has d_ref 48.*delete the folder"):
        precompute(raw, tmp_path / "out", num_workers=1, reference_model=str(other))
    shutil.rmtree(tmp_path / "out" / "_tmp")
    precompute(raw, tmp_path / "out", num_workers=1, reference_model=str(other))
    assert _all(tmp_path / "out")["ref_image"].shape == (12, 48)


def test_a_dataset_json_whose_reference_width_disagrees_is_refused(ref_sets, tmp_path):
    out = tmp_path / "set"
    shutil.copytree(ref_sets["pixels"], out)
    data = json.loads((out / "dataset.json").read_text())
    data["extra"]["reference"]["dim"] = 64
    (out / "dataset.json").write_text(json.dumps(data))
    with pytest.raises(
        ValueError,
        match=rf"{out / 'dataset.json'}: reference fields are \[48\]-d but "
        "extra.reference.dim says 64",
    ):
        TrainDataset.open(str(out))


@pytest.mark.parametrize("mode", ["pixels", "index"])
def test_checksums_cover_the_reference_and_verify_inspect_show_it(ref_sets, mode, tmp_path):
    ok = CliRunner().invoke(app, ["data", "verify", str(ref_sets[mode])], env={"COLUMNS": "300"})
    per_sample = 2 * (512 + 512) if mode == "pixels" else 2 * 48 * 2  # two padded members / two table columns
    assert ok.exit_code == 0 and f"d_ref 48, 40 px, {per_sample:,} bytes per sample" in ok.output, ok.output
    shown = CliRunner().invoke(
        app, ["data", "inspect", str(ref_sets[mode]), "--out", str(tmp_path / "r")], env={"COLUMNS": "300"}
    )
    assert f"d_ref 48, 40 px, {per_sample:,} bytes per sample" in shown.output, shown.output
    out = tmp_path / "set"
    shutil.copytree(ref_sets[mode], out)
    ds = TrainDataset.open(str(out))
    if mode == "pixels":  # a byte of sample 3's ref_text member (the 4th member: image, tokens, ref_image)
        offset = 3 * ds.sample_bytes + sum(f.padded_bytes for f in ds.fields[:3]) + 512 + 5
        target, words = out / ds.shards[0].name, "sample 3 (id 3) is damaged"
    else:  # a byte of record 3's ref_text column in the first table
        offset = 3 * ds.sample_bytes + ds.table_dtype.fields["ref_text"][1] + 5
        target, words = out / ds.shards[0].name, "damaged"
    data = bytearray(target.read_bytes())
    data[offset] ^= 0xFF
    target.write_bytes(bytes(data))
    bad = CliRunner().invoke(app, ["data", "verify", str(out)], env={"COLUMNS": "300"})
    assert bad.exit_code == 1 and str(target) in bad.output and words in bad.output, bad.output


def test_a_set_with_a_reference_trains_through_toolkit_train(ref_sets, tmp_path):
    """The extra batch keys travel through the trainer's loader workers and batches without harm (objectives
    that read them are toolkit.train's)."""
    out = tmp_path / "run"
    res = CliRunner().invoke(
        app,
        [
            "--quiet",
            "train",
            "--data",
            str(ref_sets["pixels"]),
            "--model",
            MODEL,
            "--out",
            str(out),
            "--steps",
            "2",
            "--batch-size",
            "8",
            "--workers",
            "2",
            "--set",
            "tensorboard=false",
        ],
    )
    assert res.exit_code == 0, res.output
    assert json.loads((out / "manifest.json").read_text())["status"] == "done"


def _digest(folder: Path) -> dict[str, str]:
    """sha256 of every output file; dataset.json without data_root (an index names its raw shards relative
    to its own folder, which differs between the two outputs)."""
    out = {}
    for p in sorted(folder.iterdir()):
        if p.name == "dataset.json":
            data = json.loads(p.read_text())
            data.pop("data_root", None)
            out[p.name] = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
        elif p.name.endswith((".tar", ".xxh3", ".meta.jsonl", ".idx", ".jpgs")):
            out[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["pixels", "index"])
def test_two_ranks_write_the_same_bytes_as_one_process(ref_sets, ref_dir, tmp_path, mode):
    """Rank 0 reads the other rank's scratch rows (image rows, or index records, and reference rows)."""
    out, raw = tmp_path / "two", ref_sets["pixels"].parent / "raw"
    cmd = [
        sys.executable,
        "-m",
        "toolkit",
        "data",
        "precompute",
        "--in",
        str(raw),
        "--out",
        str(out),
        "--model",
        MODEL,
        "--samples-per-shard",
        "10",
        "--workers",
        "1",
        "--set",
        "crop_scale_min=1.0",
        "--storage",
        mode,
        "--reference-model",
        str(ref_dir),
        "--nproc-per-node",
        "2",
    ]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _digest(out) == _digest(ref_sets[mode]) and len(_digest(out)) == (34 if mode == "pixels" else 23)


def test_the_reference_pass_benchmark_runs_scaled_down(tmp_path, monkeypatch):
    """benchmarks/data/reference_pass.py end to end at 20 samples: its table and JSON (no timing asserted)."""
    monkeypatch.chdir(ROOT)
    from benchmarks.data import reference_pass

    out = tmp_path / "result"
    reference_pass.main(
        [
            "--models",
            "tiny",
            "--num-samples",
            "20",
            "--workers",
            "1",
            "--work",
            str(tmp_path / "w"),
            "--out",
            str(out),
        ]
    )
    row = json.loads(out.with_suffix(".json").read_text())["rows"][0]
    assert row["d_ref"] == 128 and row["num_samples"] == 20
    assert row["bytes_added_per_sample"] == {"pixels": 2048, "jpeg/index": 512}
    assert "| cliptk-tiny | 128 | 32 | 20 |" in out.with_suffix(".md").read_text()
