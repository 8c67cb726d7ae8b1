"""`toolkit train --data D --out D` overwrote the precompute's manifest.json, config.yaml and log.jsonl and
exited 0 (issue 34, class 2): a real run must refuse it and leave the data folder as it was."""

from __future__ import annotations

import hashlib

from trainkit import MODEL, run_cli


def _digests(folder):
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_train_refuses_its_data_folder_as_run_directory(demo_train):
    before = _digests(demo_train)
    for out in (str(demo_train), f"{demo_train}/.", str(demo_train / "run")):
        proc = run_cli(
            [
                "train",
                "--data",
                str(demo_train),
                "--out",
                out,
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
