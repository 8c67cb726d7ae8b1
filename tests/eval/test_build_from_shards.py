"""`toolkit eval build-set --source shards` (issue 43 item 21): held-out raw webdataset shards (a folder, a
glob of tars) become an evaluation set directly; a user had to untar a shard and write a CSV. Real tars
written the img2dataset way, read with the training data's robust reader: a damaged tar and incomplete samples
are counted, not silently dropped."""

from __future__ import annotations

import json
import tarfile

import numpy as np
from datakit import encode, good_samples, random_image, write_raw_shard
from typer.testing import CliRunner

from toolkit.cli.main import app
from toolkit.eval.datasets import open_eval_set


def _invoke(args: list[str]):
    result = CliRunner().invoke(app, ["eval", "build-set", "--source", "shards", *args])
    assert result.exit_code == 0, result.output
    return result


def _read_set(root, name) -> list[dict]:
    eval_set = open_eval_set(root, name)
    rows = []
    for shard in eval_set.shards:
        with tarfile.open(shard) as tar:
            rows += [m.name for m in tar.getmembers()]
    return rows


def test_retrieval_set_from_a_glob_of_raw_shards(tmp_path):
    rng = np.random.default_rng(0)
    raw = tmp_path / "raw"
    raw.mkdir()
    write_raw_shard(raw / "00000.tar", good_samples(rng, "a", 5))
    no_caption = [("b0000", {"jpg": encode(random_image(rng, 32, 32), "JPEG")})]
    broken = [("b0001", {"jpg": b"not an image", "txt": b"a broken picture"})]
    write_raw_shard(raw / "00001.tar", good_samples(rng, "c", 3) + no_caption + broken)
    result = _invoke(["-i", str(raw / "*.tar"), "-o", str(tmp_path / "sets" / "held"), "--task", "retrieval"])
    assert "8 retrieval pairs" in result.output, result.output
    members = _read_set(tmp_path / "sets", "held")
    assert sum(m.endswith(".jpg") for m in members) == 8 and sum(m.endswith(".txt") for m in members) == 8
    manifest = json.loads((tmp_path / "sets" / "held" / "manifest.json").read_text())
    left_out = {"sample without a txt caption": 1, "image that does not decode": 1}
    assert manifest["counts"]["left_out"] == left_out


def test_classification_from_a_json_field_and_limit(tmp_path):
    rng = np.random.default_rng(1)
    raw = tmp_path / "raw"
    raw.mkdir()
    samples = [
        (
            f"k{i:04d}",
            {
                "png": encode(random_image(rng, 24, 24), "PNG"),
                "json": json.dumps({"label": ["cat", "dog"][i % 2]}).encode(),
            },
        )
        for i in range(6)
    ]
    write_raw_shard(raw / "00000.tar", samples)
    _invoke(
        ["-i", str(raw), "-o", str(tmp_path / "sets" / "pets"), "--caption-ext", "json:label", "--limit", "4"]
    )
    eval_set = open_eval_set(tmp_path / "sets", "pets")
    assert list(eval_set.classnames) == ["cat", "dog"] and eval_set.num_samples == 4


def test_a_damaged_tar_is_counted(tmp_path):
    rng = np.random.default_rng(2)
    raw = tmp_path / "raw"
    raw.mkdir()
    tar = write_raw_shard(raw / "00000.tar", good_samples(rng, "a", 6))
    data = tar.read_bytes()
    tar.write_bytes(data[: len(data) // 2])  # cut in the middle, as a killed download leaves it
    _invoke(["-i", str(raw), "-o", str(tmp_path / "sets" / "cut"), "--task", "retrieval"])
    manifest = json.loads((tmp_path / "sets" / "cut" / "manifest.json").read_text())
    assert manifest["counts"]["left_out"] == {"the rest of a damaged tar (truncated_tar: 00000.tar)": 1}
    assert 0 < manifest["counts"]["num_samples"] < 6
