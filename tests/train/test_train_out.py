"""train --out another stage's folder (a training set, a raw set) is refused before its manifest, config.yaml
and log.jsonl are overwritten (issue 43, item 3)."""

from __future__ import annotations

import hashlib
import json

import pytest
from trainkit import train_cfg

from toolkit.core.stage import OutputNotOurs
from toolkit.train.run import run


@pytest.mark.parametrize("kind", ["data.precompute", "data.fetch"])
def test_train_refuses_another_stages_folder(demo_train, tmp_path, kind):
    other = tmp_path / "other"
    other.mkdir()
    (other / "manifest.json").write_text(
        json.dumps({"kind": kind, "status": "done", "counts": {"num_samples": 9}})
    )
    (other / "config.yaml").write_text("model: cliptk-tiny\n")
    (other / "log.jsonl").write_text("{}\n")
    (other / "00000.tar").write_bytes(b"shard")
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in other.iterdir()}
    with pytest.raises(OutputNotOurs, match=f"holds the output of a '{kind}' stage"):
        run(train_cfg(demo_train, other, steps=1))
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in other.iterdir()} == before
