"""The three storage modes (pixels, jpeg, index): each keeps dense ids, skip accounting, checked reads,
`toolkit data verify`, world-independent batches with exact resume, and `inspect`'s mode and bytes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from datakit import precompute, read_meta
from typer.testing import CliRunner

from toolkit.cli.main import app
from toolkit.data.trainset.format import TrainDataset
from toolkit.data.trainset.integrity import DataIntegrityError
from toolkit.data.trainset.loader import make_loader

MODES = ("pixels", "jpeg", "index")


@pytest.fixture(scope="module")
def small_sets(small_raw, tmp_path_factory) -> dict[str, Path]:
    """small_raw (103 samples in 5 raw shards) in every mode, parts of 10; the index's raw shards are
    copied beside it (``raw/``) so damage tests may write into them."""
    root = tmp_path_factory.mktemp("modes")
    shutil.copytree(small_raw, root / "raw")
    return {m: _precompute(root / "raw", root / m, m) for m in MODES}


def _precompute(raw: Path, out: Path, mode: str) -> Path:
    precompute(raw, out, num_workers=2, samples_per_shard=10, storage=mode)
    return out


def _all(path, **kw) -> dict[str, np.ndarray]:
    batches = list(make_loader(str(path), batch_size=16, shuffle=False, **kw))
    return {k: np.concatenate([b[k].numpy() for b in batches]) for k in ("image", "tokens", "index")}


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float(10 * np.log10(255.0**2 / mse))


@pytest.mark.parametrize("mode", ["jpeg", "index"])
def test_modes_hold_the_same_samples_as_pixels(small_sets, mode):
    pixels, other = _all(small_sets["pixels"]), _all(small_sets[mode])
    assert (other["index"] == np.arange(103)).all()
    assert (other["tokens"] == pixels["tokens"]).all()
    if mode == "index":  # decoded in the loader exactly as precompute decodes for pixels
        assert (other["image"] == pixels["image"]).all()
    else:  # random-noise images are JPEG's worst case; q90 keeps them above 25 dB
        assert _psnr(other["image"], pixels["image"]) > 25
    assert read_meta(small_sets[mode]) == read_meta(small_sets["pixels"])


@pytest.mark.parametrize("mode", ["jpeg", "index"])
def test_dense_ids_and_skip_accounting_match_pixels(bad_raw, bad_train, mode, tmp_path):
    out = tmp_path / mode
    result = precompute(
        bad_raw[0], out, num_workers=2, samples_per_shard=7, storage=mode, max_truncated_share=1
    )  # bad_raw is truncated on purpose, as bad_train keeps it
    assert result.counts["skipped"] == bad_train[1].counts["skipped"]
    assert result.counts["num_samples"] == bad_train[1].counts["num_samples"]
    assert [m["key"] for m in read_meta(out)] == [m["key"] for m in read_meta(bad_train[0])]
    assert [m["id"] for m in read_meta(out)] == list(range(result.counts["num_samples"]))

    def skipped(folder: Path) -> list[tuple]:  # messages name PIL's in-memory file object: compare the rest
        rows = [json.loads(line) for line in (folder / "skipped.jsonl").read_text().splitlines()]
        return [(r["reason"], r["shard"], r["key"]) for r in rows]

    assert skipped(out) == skipped(bad_train[0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [2, 4])
def test_global_batches_are_world_independent_and_resume_at_another_world_size(small_sets, mode, world):
    path = str(small_sets[mode])

    def steps(rank: int, ws: int, start: int, workers: int = 0) -> list[dict]:
        loader = make_loader(
            path,
            batch_size=8,
            rank=rank,
            world_size=ws,
            seed=3,
            start_step=start,
            num_steps=4,
            num_workers=workers,
        )
        return [{k: b[k].numpy() for k in ("image", "tokens", "index")} for b in loader]

    one = steps(0, 1, 0) + steps(0, 1, 4)
    ranks = [steps(r, world, 0) for r in range(world)]
    resumed = [steps(r, world, 4, workers=2 if r == 0 else 0) for r in range(world)]  # resume at 4 on K ranks
    for t in range(8):
        parts = [ranks[r][t] if t < 4 else resumed[r][t - 4] for r in range(world)]
        for k in ("image", "tokens", "index"):
            assert (np.concatenate([p[k] for p in parts]) == one[t][k]).all(), (t, k)


def _copy(small_sets, mode: str, tmp_path: Path) -> Path:
    """A private copy of one mode's folder (with the raw shards beside it for index)."""
    shutil.copytree(small_sets[mode], tmp_path / mode)
    if mode == "index":
        shutil.copytree(small_sets["index"].parent / "raw", tmp_path / "raw")
    return tmp_path / mode


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _damage_sample(out: Path, ds: TrainDataset, sample_id: int) -> tuple[Path, str]:
    """Flip a byte inside sample ``sample_id``'s stored image; (file flipped, words the error must hold)."""
    part = next(i for i, s in enumerate(ds.shards) if s.first_id <= sample_id < s.first_id + s.num_samples)
    position = sample_id - ds.shards[part].first_id
    if ds.storage == "pixels":
        path = out / ds.shards[part].name
        _flip(path, position * ds.sample_bytes + 512 + 100)
        return path, f"{path}: sample {position} (id {sample_id}) is damaged"
    from toolkit.data.trainset.storage.tables import load_table, resolve_data_root

    rec = load_table(ds, part)[position]
    path = Path(resolve_data_root(str(out), ds.data_root)) / ds.data_files[int(rec["file"])]
    _flip(path, int(rec["offset"]) + int(rec["length"]) // 2)
    return path, f"of sample {position} of {ds.shards[part].name} (id {sample_id}) are damaged"


@pytest.mark.parametrize("mode", MODES)
def test_a_flipped_image_byte_fails_the_read_and_verify_names_it(small_sets, mode, tmp_path):
    out = _copy(small_sets, mode, tmp_path)
    ok = CliRunner().invoke(app, ["data", "verify", str(out)])
    assert ok.exit_code == 0 and "ok: every sample is intact" in ok.output, ok.output
    ds = TrainDataset.open(str(out))
    path, words = _damage_sample(out, ds, 37)
    with pytest.raises(DataIntegrityError) as err:
        _all(out)
    assert words in str(err.value)
    res = CliRunner().invoke(app, ["data", "verify", str(out)], env={"COLUMNS": "300"})
    assert res.exit_code == 1, res.output
    assert [line for line in res.output.splitlines() if line.startswith("damaged: ")] == [
        f"damaged: {str(err.value).split('; run `toolkit data verify')[0]}"
    ]


@pytest.mark.parametrize("mode", ["jpeg", "index"])
def test_a_damaged_table_is_named(small_sets, mode, tmp_path):
    out = _copy(small_sets, mode, tmp_path)
    _flip(out / "00002.idx", 30)
    with pytest.raises(DataIntegrityError, match=r"00002\.idx: damaged .*hash differs from dataset\.json"):
        _all(out)
    res = CliRunner().invoke(app, ["data", "verify", str(out)], env={"COLUMNS": "300"})
    assert res.exit_code == 1 and "00002.idx: damaged" in res.output, res.output


def test_an_index_moved_with_its_shards_or_opened_as_a_url_still_reads(small_sets, tmp_path):
    # an fsspec URL (file://; HTTP would need aiohttp, not installed here): ../raw resolves inside the URL
    ds = TrainDataset.open(str(small_sets["index"]))
    assert ds.data_root == "../raw" and ds.data_files[:2] == ["00000.tar", "00001.tar"]
    moved = _copy(small_sets, "index", tmp_path / "elsewhere")
    expected = _all(small_sets["pixels"])
    assert (_all(moved)["image"] == expected["image"]).all()
    served = _all(f"file://{tmp_path}/elsewhere/index")
    assert (served["image"] == expected["image"]).all() and (served["tokens"] == expected["tokens"]).all()


def test_a_missing_raw_shard_is_named(small_sets, tmp_path):
    out = _copy(small_sets, "index", tmp_path)
    (tmp_path / "raw" / "00001.tar").unlink()
    with pytest.raises(DataIntegrityError, match=r"raw/00001\.tar: missing .*data_root '\.\./raw'"):
        _all(out)


@pytest.mark.parametrize("mode", MODES)
def test_inspect_shows_the_mode_and_bytes_per_sample(small_sets, mode, tmp_path):
    res = CliRunner().invoke(
        app, ["data", "inspect", str(small_sets[mode]), "--out", str(tmp_path / "r"), "--num-contact", "4"]
    )
    assert res.exit_code == 0, res.output
    report = json.loads((tmp_path / "r" / "report.json").read_text())
    assert report["storage"] == mode
    per_sample = report["bytes_per_sample"]
    assert f"storage: {mode}, {per_sample:,} bytes per sample on disk" in res.output
    stored = sum(p.stat().st_size for p in small_sets[mode].iterdir() if p.name[:5].isdigit())
    assert report["stored_bytes"] == stored
    assert (tmp_path / "r" / "contact_sheet.png").is_file()


def test_switching_modes_in_one_folder_leaves_no_stale_files(small_raw, tmp_path):
    out = tmp_path / "set"
    precompute(small_raw, out, num_workers=1, samples_per_shard=50, storage="pixels")
    precompute(
        small_raw,
        out,
        num_workers=1,
        samples_per_shard=50,
        storage="index",
    )
    assert sorted(p.suffix for p in out.glob("0000*")) == [".idx"] * 3 + [".jsonl"] * 3


@pytest.mark.parametrize("mode", ["jpeg", "index"])
def test_each_mode_trains_through_toolkit_train(small_sets, mode, tmp_path):
    out = tmp_path / "run"
    res = CliRunner().invoke(
        app,
        [
            "--quiet",
            "train",
            "--data",
            str(small_sets[mode]),
            "--model",
            "cliptk-tiny",
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
    trained = json.loads((out / "manifest.json").read_text())
    assert trained["status"] == "done" and (out / "model" / "open_clip_model.safetensors").is_file()


def test_the_index_pipeline_runs_scaled_down(tmp_path):
    pipeline = Path(__file__).resolve().parents[3] / "pipelines" / "index.yaml"
    sets = {
        "run_dir": str(tmp_path / "run"),
        "vars.num_concepts": 24,
        "vars.port": 0,
        "vars.steps": 2,
        "vars.batch_size": 8,
        "stages.train.loader.num_workers": 0,
        "stages.fetch.samples_per_shard": 10,
    }
    args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    res = CliRunner().invoke(app, ["--quiet", "pipeline", "run", str(pipeline), *args])
    assert res.exit_code == 0, res.output
    ds = TrainDataset.open(str(tmp_path / "run" / "precompute"))
    assert ds.storage == "index" and ds.data_root == "../raw" and ds.num_samples == 24
    assert not list((tmp_path / "run" / "precompute").glob("*.tar"))  # no copy of the images
    trained = json.loads((tmp_path / "run" / "train" / "manifest.json").read_text())
    assert trained["status"] == "done"


def test_index_mode_refuses_a_compressed_tar_naming_it(small_raw, tmp_path):
    import gzip

    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "00000.tar").write_bytes(gzip.compress((small_raw / "00000.tar").read_bytes()))
    with pytest.raises(
        RuntimeError, match=r"00000\.tar: ValueError: .*storage index needs uncompressed tars"
    ):
        precompute(raw, tmp_path / "index", num_workers=1, storage="index")
    ok = precompute(raw, tmp_path / "pixels", num_workers=1)  # the other modes read it through tarfile
    assert ok.counts["num_samples"] == 30


def test_index_of_a_single_shard_given_by_a_relative_path(small_raw, tmp_path, monkeypatch):
    shutil.copy(small_raw / "00001.tar", tmp_path / "one.tar")
    monkeypatch.chdir(tmp_path)
    precompute("one.tar", "sets/index", num_workers=1, storage="index")
    ds = TrainDataset.open("sets/index")
    assert (ds.data_root, ds.data_files) == ("../..", ["one.tar"])
    assert len(_all("sets/index")["index"]) == 17


@pytest.mark.parametrize("mode", ["pixels", "index"])
def test_the_disk_figure_toolkit_plan_prints_is_what_precompute_writes(small_sets, mode):
    """pixels: the tar sample and its 8-byte checksum; index: the table record (jpeg's size is an
    estimate)."""
    from toolkit.data.trainset import storage

    ds = TrainDataset.open(str(small_sets[mode]))
    written = json.loads((small_sets[mode] / "dataset.json").read_text())["sample_bytes"]
    figure = storage.get(mode).disk_bytes_per_sample(ds.field("image").shape[0], ds.field("tokens").shape[0])
    assert figure == written + (8 if mode == "pixels" else 0)
