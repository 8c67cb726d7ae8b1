"""An output that is, holds or lies inside an input is refused, however either path is spelled (issue 34,
class 1 and 2): unit checks of the comparison, then real `toolkit` runs that must leave their input intact."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.core.pathguard import OutputIsInput, check_output_apart, relation

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return dict(
        os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled"
    )


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_spellings_of_the_same_folder_are_the_same(tmp_path, monkeypatch):
    raw = tmp_path / "r"
    raw.mkdir()
    (tmp_path / "link").symlink_to(raw)
    monkeypatch.chdir(tmp_path)
    for spelling in ("r", "./r/", str(raw), f"file://{raw}", str(tmp_path / "link"), f"{tmp_path}/x/../r"):
        assert relation(spelling, "r") == "is", spelling
    assert relation(str(raw / "train"), "r") == "lies inside"
    assert relation(str(tmp_path), "r/00000.tar") == "holds"
    assert (
        relation(str(tmp_path / "link"), str(raw / "{00000..00003}.tar")) == "is"
    )  # a brace pattern's folder
    assert relation(str(tmp_path / "rr"), "r") is None  # a name that only starts like the input
    assert relation("memory://a/b/", "memory:///a/b") == "is"
    assert relation("memory://a/b/c", "memory://a/b") == "lies inside"
    assert relation("memory://a/b", "r") is None


def test_a_hard_link_to_an_input_file_is_the_input(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f.tar").write_bytes(b"x")
    os.link(tmp_path / "a" / "f.tar", tmp_path / "g.tar")  # filesystem identity, not the path, decides
    assert relation(str(tmp_path / "g.tar"), str(tmp_path / "a" / "f.tar")) == "is"


def test_the_error_names_the_key_and_both_paths(tmp_path):
    with pytest.raises(OutputIsInput, match=r"train: out: must differ from input data \(.*D\): .*D/ is it"):
        check_output_apart("train", f"{tmp_path}/D/", {"data": f"{tmp_path}/D"})


def test_precompute_refuses_its_input_spelled_another_way(tmp_path):
    """`cp -a RAW r && toolkit data precompute --in r --out $PWD/r` replaced the raw shards and exited 0."""
    import numpy as np
    from datakit import good_samples, write_raw_shard

    raw = tmp_path / "r"
    raw.mkdir()
    write_raw_shard(raw / "00000.tar", good_samples(np.random.default_rng(0), "k", 4))
    before = _digests(raw)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "toolkit",
            "data",
            "precompute",
            "--in",
            "r",
            "--out",
            str(raw),
            "--model",
            "cliptk-tiny",
            "--workers",
            "1",
        ],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "must differ from input input (r)" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert _digests(raw) == before  # nothing written, not even a lock or a manifest
