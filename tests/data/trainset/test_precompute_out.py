"""precompute --out never deletes or replaces files it did not write, nor another stage's books (issue 43,
items 2 and 3): a user's 00001.tar, another raw set's shards and manifest, a run's manifest."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
from datakit import good_samples, precompute, write_raw_shard

from toolkit.core.pathguard import OutputIsInput
from toolkit.core.stage import OutputNotOurs


def _digests(folder) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def raw(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    write_raw_shard(raw / "00000.tar", good_samples(np.random.default_rng(0), "a", 3))
    return raw


def test_precompute_keeps_a_users_shard_named_files(raw, tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "00001.tar").write_bytes(b"my own tar")
    (user / "00003.idx").write_bytes(b"my own index")
    before = _digests(user)
    with pytest.raises(
        OutputNotOurs, match=r"holds 2 file\(s\) named like data.precompute's output \(e.g. 00001.tar\)"
    ):
        precompute(raw, user)
    assert _digests(user) == before


def test_precompute_keeps_another_raw_sets_shards_and_manifest(raw, tmp_path):
    other = tmp_path / "other_raw"
    other.mkdir()
    for i in range(3):
        write_raw_shard(other / f"{i:05d}.tar", good_samples(np.random.default_rng(i + 1), f"o{i}", 2))
    (other / "manifest.json").write_text(json.dumps({"kind": "data.fetch", "status": "done"}))
    before = _digests(other)
    with pytest.raises(OutputNotOurs, match=r"holds the output of a 'data.fetch' stage"):
        precompute(raw, other)
    assert _digests(other) == before


def test_precompute_refuses_a_run_folder_and_a_foreign_manifest(raw, tmp_path):
    for name, manifest in (("run", json.dumps({"kind": "train", "status": "done"})), ("odd", "not json")):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "manifest.json").write_text(manifest)
        (folder / "config.yaml").write_text("steps: 2\n")
        before = _digests(folder)
        with pytest.raises(OutputNotOurs, match="would overwrite its manifest, config and log"):
            precompute(raw, folder)
        assert _digests(folder) == before


def test_precompute_reruns_into_its_own_output(raw, tmp_path):
    out = tmp_path / "train"
    first = precompute(raw, out)
    again = precompute(raw, out)
    assert first.counts["num_samples"] == again.counts["num_samples"] == 3


def test_a_hard_link_of_an_input_file_inside_out_is_refused(raw, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.link(raw / "00000.tar", out / "00007.tar")
    with pytest.raises(
        OutputIsInput, match=r"holds 00007.tar, the same file \(a hard link\) as a file of it"
    ):
        precompute(raw, out)
    single = tmp_path / "single"  # an input that is one tar file, linked under another name
    single.mkdir()
    os.link(raw / "00000.tar", single / "mine.tar")
    with pytest.raises(OutputIsInput, match="mine.tar"):
        precompute(raw / "00000.tar", single)


def test_precompute_refuses_a_raw_set_whose_fetch_failed(raw, tmp_path, caplog):
    """Before: exit 0 with the samples of the shards the failed fetch finished, the failure never
    mentioned."""
    from toolkit.core.stage import UnfinishedInput

    (raw / "manifest.json").write_text(
        json.dumps(
            {"kind": "data.fetch", "status": "failed", "error": "RuntimeError: 2 of 4 shards unfinished"}
        )
    )
    with pytest.raises(
        UnfinishedInput,
        match=r"input: .*raw: its manifest.json says the data.fetch that wrote it is "
        r"'failed' \(RuntimeError: 2 of 4 shards unfinished\).*"
        r"--allow-unfinished-input",
    ):
        precompute(raw, tmp_path / "train")
    assert not (tmp_path / "train").exists()
    result = precompute(raw, tmp_path / "train", allow_unfinished_input=True)
    assert result.counts["num_samples"] == 3
    assert any(
        "'failed'" in r.getMessage() and "only what it finished is read" in r.getMessage()
        for r in caplog.records
    )
