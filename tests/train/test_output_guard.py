"""`toolkit train --data D --out D` overwrote the precompute's manifest.json, config.yaml and log.jsonl and
exited 0 (issue 34, class 2): a real run must refuse it and leave the data folder as it was."""

from __future__ import annotations

import hashlib

import pytest
from trainkit import MODEL, run_cli, train_cfg


def _digests(folder):
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_train_refuses_its_data_folder_as_run_directory(demo_train):
    """The real command once (exit code 2, one line, the data untouched); the other two spellings of an
    output inside the data through the same train stage in this process (each CLI launch costs ~5 s of
    imports; every spelling's relation is checked in tests/core/test_pathguard.py)."""
    from toolkit.core.pathguard import OutputIsInput
    from toolkit.train.run import run

    before = _digests(demo_train)
    proc = run_cli(
        [
            "train",
            "--data",
            str(demo_train),
            "--out",
            str(demo_train),
            "--model",
            MODEL,
            "--batch-size",
            "16",
            "--steps",
            "1",
        ]
    )
    assert proc.returncode == 2, proc.stderr
    assert "must differ from input data" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert _digests(demo_train) == before
    for out in (f"{demo_train}/.", str(demo_train / "run")):
        with pytest.raises(OutputIsInput, match="must differ from input data"):
            run(train_cfg(demo_train, out, steps=1))
        assert _digests(demo_train) == before
