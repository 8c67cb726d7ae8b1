"""dataset.json is checked before it is believed (issue 43 item 12): an empty set is not "intact", a shard
name cannot leave the set's folder, and a count the files cannot hold is refused naming the key, not by a
terabyte allocation."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from datakit import good_samples, precompute, write_raw_shard
from typer.testing import CliRunner

from toolkit.cli.main import app
from toolkit.data.trainset.format import TrainDataset
from toolkit.data.trainset.integrity import check_claims


@pytest.fixture(scope="module")
def small_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("claims")
    raw = root / "raw"
    raw.mkdir()
    write_raw_shard(raw / "00000.tar", good_samples(np.random.default_rng(0), "a", 3))
    precompute(raw, root / "train")
    return root / "train"


def _edited(small_set, tmp_path, edit) -> str:
    copy = tmp_path / "set"
    shutil.copytree(small_set, copy)
    data = json.loads((copy / "dataset.json").read_text())
    edit(data)
    (copy / "dataset.json").write_text(json.dumps(data))
    return str(copy)


def test_verify_of_a_set_without_samples_fails(small_set, tmp_path):
    """Before: "ok: every sample is intact", exit 0."""
    empty = _edited(small_set, tmp_path, lambda d: d.update(num_samples=0, shards=[]))
    result = CliRunner().invoke(app, ["--quiet", "data", "verify", empty])
    assert result.exit_code == 1 and "num_samples is 0" in result.output and "intact" not in result.output


def test_a_shard_name_outside_the_set_is_refused(small_set, tmp_path):
    """Before: ../../other/00001.tar was read from outside the set's folder."""
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(small_set / "00000.tar", other / "00001.tar")
    shutil.copy(small_set / "00000.xxh3", other / "00001.xxh3")

    def escape(d):
        d["shards"][0]["name"] = "../other/00001.tar"

    path = _edited(small_set, tmp_path, escape)
    with pytest.raises(
        ValueError, match=r"dataset.json: shards\[0\].name '../other/00001.tar' is not a file name"
    ):
        TrainDataset.open(path)
    result = CliRunner().invoke(app, ["--quiet", "data", "verify", path])
    assert result.exit_code == 1 and "shards[0].name" in result.output


def test_a_count_the_files_cannot_hold_is_refused_naming_the_key(small_set, tmp_path):
    """Before: `toolkit train` tried to allocate 8 TB for FastCLIP's tables and said only that."""

    def claim(d):
        d["num_samples"] = d["shards"][0]["num_samples"] = d["samples_per_shard"] = 10**12

    path = _edited(small_set, tmp_path, claim)
    with pytest.raises(
        ValueError,
        match=r"dataset.json: shards\[0\].num_samples says 1000000000000 samples .* "
        r"holds \d+ bytes \(\d samples at most\)",
    ):
        ds = TrainDataset.open(path)
        check_claims(ds, ds.sample_bytes)  # a pixels set: a part holds sample_bytes per sample
    real = TrainDataset.open(str(small_set))
    check_claims(real, real.sample_bytes)  # the real set passes
    result = CliRunner().invoke(
        app,
        [
            "--quiet",
            "train",
            "--data",
            path,
            "--out",
            str(tmp_path / "run"),
            "--model",
            "cliptk-tiny",
            "--steps",
            "1",
            "--batch-size",
            "2",
        ],
    )
    assert result.exit_code == 1 and "shards[0].num_samples" in result.output, result.output
    assert "allocate" not in result.output
