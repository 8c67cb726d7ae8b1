"""Damaged training shards: checksums and token ids checked on read, `toolkit data verify`, and errors from
DataLoader workers raised as themselves (issue 25 items 1 and 3)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from toolkit.cli.main import app
from toolkit.data.trainset import integrity
from toolkit.data.trainset.format import TrainDataset
from toolkit.data.trainset.loader import make_loader
from toolkit.data.trainset.segment import Segment, field_offsets, read_segment


@pytest.fixture()
def train_copy(small_train, tmp_path) -> Path:
    """A private copy of small_train (11 shards of 10 samples, the last holding 3) to damage."""
    out = tmp_path / "train"
    shutil.copytree(small_train[0], out)
    integrity._NOTICED.clear()
    return out


def _flip(path: Path, offset: int, count: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + count] = bytes(b ^ 0xFF for b in data[offset : offset + count])
    path.write_bytes(bytes(data))


def _field_offset(out: Path, role: str) -> int:
    ds = TrainDataset.open(str(out))
    return field_offsets(ds)[[f.role for f in ds.fields].index(role)]


def _read_all(out: Path, workers: int) -> int:
    """Every sample once, through the training loader (batches of 5 ids, 20 steps = 100 samples)."""
    return sum(
        len(b["index"]) for b in make_loader(str(out), batch_size=5, num_workers=workers, num_steps=20)
    )


def _strip_checksums(out: Path) -> None:
    """What a folder precomputed before checksums looks like: no sidecars, no sums, no vocab_size."""
    meta = json.loads((out / "dataset.json").read_text())
    for shard in meta["shards"]:
        shard.pop("sums")
    meta["extra"].pop("vocab_size")
    (out / "dataset.json").write_text(json.dumps(meta))
    for path in out.glob("*.xxh3"):
        path.unlink()


def test_precompute_writes_checksums_that_match_every_sample(small_train):
    out = Path(small_train[0])
    ds = TrainDataset.open(str(out))
    assert all(len(s.sums) == 16 for s in ds.shards) and ds.extra["vocab_size"] == 49408
    for index, shard in enumerate(ds.shards):
        sums = integrity.load_sums(ds, index)
        data = (out / shard.name).read_bytes()
        size = ds.sample_bytes
        assert [
            integrity.sample_hash(data[k * size : (k + 1) * size]) for k in range(shard.num_samples)
        ] == list(sums)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers", [0, 2])
def test_flipped_pixel_bytes_fail_naming_shard_and_sample(train_copy, workers):
    ds = TrainDataset.open(str(train_copy))
    _flip(train_copy / "00004.tar", 6 * ds.sample_bytes + _field_offset(train_copy, "image") + 100, 64)
    with pytest.raises(integrity.DataIntegrityError) as err:
        _read_all(train_copy, workers)
    message = str(err.value)
    assert "00004.tar: sample 6 (id 46) is damaged: its checksum does not match" in message
    assert "Caught" not in message and "worker" not in message and "Traceback" not in message
    with pytest.raises(integrity.DataIntegrityError, match="00004.tar: sample 6 "):
        list(read_segment(ds, Segment(4, 0, 10)))


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers", [0, 2])
def test_token_ids_outside_the_vocabulary_are_refused_without_checksums(train_copy, workers, caplog):
    """An old folder (no checksums): 8 flipped bytes in a token member give an error naming the sample,
    not open_clip's `IndexError: index out of range in self`; the folder otherwise still trains, with a
    one-line notice."""
    _strip_checksums(train_copy)
    with caplog.at_level(logging.WARNING, logger="toolkit"):
        assert _read_all(train_copy, 0) == 100
    notices = [r for r in caplog.records if "no checksums" in r.getMessage()]
    assert len(notices) == 1 and "precompute` again" in notices[0].getMessage()
    ds = TrainDataset.open(str(train_copy))
    _flip(train_copy / "00002.tar", 3 * ds.sample_bytes + _field_offset(train_copy, "tokens") + 8, 8)
    with pytest.raises(integrity.DataIntegrityError) as err:
        _read_all(train_copy, workers)
    assert "00002.tar: sample 3 (id 23) is damaged: token 2 is" in str(err.value)
    assert "outside the vocabulary [0, 49408)" in str(err.value) and "Caught" not in str(err.value)


def test_token_bound_is_checked_even_when_the_checksums_agree(train_copy):
    """A tokenizer mismatch, not damage: checksums match, the ids still must not reach the model."""
    ds = TrainDataset.open(str(train_copy))
    meta = json.loads((train_copy / "dataset.json").read_text())
    meta["extra"]["vocab_size"] = 300  # pretend a 300-token tokenizer wrote them
    (train_copy / "dataset.json").write_text(json.dumps(meta))
    with pytest.raises(
        integrity.DataIntegrityError,
        match=r"00000.tar: sample 0 \(id 0\).*outside the "
        r"vocabulary \[0, 300\)",
    ):
        list(read_segment(TrainDataset.open(str(train_copy)), Segment(0, 0, 2)))
    assert ds.extra["vocab_size"] == 49408


def test_a_damaged_or_missing_checksum_file_is_named(train_copy):
    _flip(train_copy / "00001.xxh3", 3, 1)
    with pytest.raises(integrity.DataIntegrityError, match=r"00001.xxh3: damaged"):
        _read_all(train_copy, 0)
    (train_copy / "00001.xxh3").unlink()
    with pytest.raises(
        integrity.DataIntegrityError, match=r"00001.xxh3: missing \(the checksums of 00001.tar\)"
    ):
        _read_all(train_copy, 0)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("damage", ["truncated", "deleted", "header"])
def test_worker_errors_reach_the_caller_as_themselves(train_copy, damage):
    """Item 3: with workers, a truncated shard, a deleted shard or a damaged member header raise the
    same one-line error as without workers (not torch's 'Caught ValueError in DataLoader worker')."""
    ds = TrainDataset.open(str(train_copy))
    shard = train_copy / "00007.tar"
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[: 4 * ds.sample_bytes + 700])
    elif damage == "deleted":
        shard.unlink()
    else:
        _flip(shard, 2 * ds.sample_bytes + 3, 4)  # inside the first member's name
    errors = []
    for workers in (0, 2):
        with pytest.raises(ValueError) as err:
            _read_all(train_copy, workers)
        errors.append(err.value)
    assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1])
    assert "00007.tar" in str(errors[1]) and "\n" not in str(errors[1]) and "Caught" not in str(errors[1])


def _verify(out: Path, *extra: str):
    return CliRunner().invoke(app, ["data", "verify", str(out), *extra], env={"COLUMNS": "200"})


def test_verify_cli_passes_an_intact_folder_and_lists_every_damaged_sample(train_copy):
    res = _verify(train_copy)
    assert res.exit_code == 0, res.output
    assert "103 samples in 11 shards (per-sample xxh3-64 checksums, layout, token ids < 49408)" in res.output
    assert "ok: every sample is intact" in res.output
    ds = TrainDataset.open(str(train_copy))
    for k in (1, 8):
        _flip(train_copy / "00003.tar", k * ds.sample_bytes + _field_offset(train_copy, "image") + 50, 64)
    _flip(train_copy / "00009.tar", 5 * ds.sample_bytes + 2, 1)  # a member name
    res = _verify(train_copy)
    assert res.exit_code == 1, res.output
    lines = [line for line in res.output.splitlines() if line.startswith("damaged: ")]
    assert len(lines) == 3
    assert "00003.tar: sample 1 (id 31) is damaged: its checksum" in lines[0]
    assert "00003.tar: sample 8 (id 38) is damaged: its checksum" in lines[1]
    assert (
        "00009.tar: sample 5 (id 95) is damaged: its first member is not named 0000000095.img.u8" in lines[2]
    )
    assert "3 damaged samples in 2 of 11 shards: 00003.tar, 00009.tar" in res.output


def test_verify_cli_on_old_folders_truncated_shards_and_non_datasets(train_copy, tmp_path):
    ds = TrainDataset.open(str(train_copy))
    _strip_checksums(train_copy)
    _flip(train_copy / "00000.tar", 9 * ds.sample_bytes + _field_offset(train_copy, "tokens"), 8)
    shard = train_copy / "00005.tar"
    shard.write_bytes(shard.read_bytes()[: 7 * ds.sample_bytes + 100])
    res = _verify(train_copy)
    assert res.exit_code == 1, res.output
    assert "no checksums recorded (older precompute), layout, token ids < 49408" in res.output
    assert "00000.tar: sample 9 (id 9) is damaged: token 0 is" in res.output
    assert f"00005.tar: ends inside sample 7 ({7 * ds.sample_bytes + 100} bytes" in res.output
    res = _verify(tmp_path / "nothing")
    assert res.exit_code == 1 and "dataset.json: not found" in res.output
