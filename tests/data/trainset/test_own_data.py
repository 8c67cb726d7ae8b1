"""A researcher's own webdataset shards, made the way other tools make them (not by our fetch): captions only
inside ``.json``, keys in sub-folders, directory entries, odd image extensions. Real tars, real precompute runs."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
from datakit import encode, random_image, read_meta

from toolkit.core.config import build
from toolkit.data.trainset.precompute import PrecomputeConfig, run


def _tar(path, members: list[tuple[str, bytes | None]]) -> None:
    """A plain tar of (name, bytes) members; bytes None adds a directory entry."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _precompute(raw, out, **overrides):
    cfg = build(PrecomputeConfig, {"input": str(raw), "out": str(out), "model": "cliptk-tiny",
                                   "crop_scale_min": 1.0, "num_workers": 1, **overrides})
    return run(cfg)


def _skipped(out) -> list[dict]:
    return [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]


def test_captions_only_in_json(tmp_path):
    """img2dataset writes the caption into .json as well; a set that carries it only there is read with
    --caption-ext json (the caption string, not the JSON text), and the default names the way out."""
    rng = np.random.default_rng(0)
    members = []
    for i in range(6):
        members.append((f"{i:04d}.jpg", encode(random_image(rng, 40, 30), "JPEG")))
        meta = {"key": f"{i:04d}", "caption": f"caption {i} ünïcode", "url": "http://x"}
        if i == 4:
            meta = {"key": "0004", "caption": 17}
        if i == 5:
            meta = {"key": "0005"}
        members.append((f"{i:04d}.json", json.dumps(meta).encode()))
    members.append(("0006.jpg", encode(random_image(rng, 40, 30), "JPEG")))
    members.append(("0006.json", b"{not json"))
    raw = tmp_path / "raw"
    raw.mkdir()
    _tar(raw / "00000.tar", members)

    out = tmp_path / "json"
    result = _precompute(raw, out, caption_ext="json")
    assert [m["caption"] for m in read_meta(out)] == [f"caption {i} ünïcode" for i in range(4)]
    assert result.counts["skipped"] == {"bad_caption_json": 2, "missing_caption": 1}
    by_key = {s["key"]: s for s in _skipped(out)}
    assert "'caption' of the .json member is a int" in by_key["0004"]["message"]
    assert by_key["0005"]["message"] == "the .json member has no 'caption' key"
    assert "not valid JSON" in by_key["0006"]["message"]

    custom = tmp_path / "custom"
    members = [("a.jpg", encode(random_image(rng, 40, 30), "JPEG")), ("a.json", b'{"TEXT": " hello "}')]
    _tar(raw / "00000.tar", members)
    _precompute(raw, custom, caption_ext="json:TEXT")
    assert [m["caption"] for m in read_meta(custom)] == ["hello"]

    with_txt = tmp_path / "txt"
    _tar(raw / "00000.tar", [("a.jpg", members[0][1]), ("a.json", b'{"caption": "x"}'),
                             ("b.jpg", members[0][1]), ("b.txt", b"b caption")])
    _precompute(raw, with_txt)
    assert _skipped(with_txt)[0]["message"] == ("no .txt member (its .json member has a 'caption': "
                                                "--caption-ext json reads it)")


def test_dotted_file_names_are_explained(tmp_path):
    """Files named photo.0001.jpg / photo.0001.txt all share webdataset's key 'photo' (a key ends at the first
    dot): the set collapses into one sample, and the error says why instead of a bare 'missing_caption: 1'."""
    rng = np.random.default_rng(1)
    raw = tmp_path / "raw"
    raw.mkdir()
    members = []
    for i in range(8):
        members += [(f"photo.{i:04d}.jpg", encode(random_image(rng, 20, 20), "JPEG")),
                    (f"photo.{i:04d}.txt", b"a caption")]
    _tar(raw / "00000.tar", members)
    with pytest.raises(ValueError) as err:
        _precompute(raw, tmp_path / "out")
    message = str(err.value)
    assert "no valid sample in 1 raw shard(s) (missing_caption: 1); e.g. 00000.tar key 'photo': no .txt member" in message
    assert "(16 in all); a key ends at the first dot of the file name" in message
