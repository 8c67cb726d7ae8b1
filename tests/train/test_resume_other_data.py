"""A resume onto a training set re-precomputed at the same path (issue 34, class 6): refused, naming the
checkpoint and both data sets, unless checkpoint.allow_other_data is set. Real `toolkit` runs."""

from __future__ import annotations

import shutil

import pytest
from trainkit import MODEL, run_cli


@pytest.fixture(scope="module")
def other_data(demo_train, tmp_path_factory):
    """The training set re-precomputed from 3 of its 4 raw shards (150 samples, not 160) by the real command,
    once for both losses: each test copies it over its own D (what a re-precompute at D's path leaves)."""
    out = tmp_path_factory.mktemp("other_data") / "D"
    again = run_cli(
        [
            "data",
            "precompute",
            "--in",
            f"{demo_train.parent}/raw/{{00000..00002}}.tar",
            "--out",
            str(out),
            "--model",
            MODEL,
            "--samples-per-shard",
            "50",
            "--workers",
            "1",
        ]
    )
    assert again.returncode == 0, again.stderr[-3000:]
    return out


@pytest.mark.parametrize("loss", ["openclip", "fastclip-v3"])  # no per-sample tables / per-sample tables
def test_resume_onto_other_data_is_refused_naming_both(demo_train, other_data, tmp_path, loss):
    data, out = tmp_path / "D", tmp_path / "run"
    shutil.copytree(demo_train, data)
    args = [
        "train",
        "--data",
        str(data),
        "--out",
        str(out),
        "--model",
        MODEL,
        "--batch-size",
        "16",
        "--steps",
        "4",
        "--loss",
        loss,
        "--workers",
        "0",
        "--set",
        "tensorboard=false",
    ]
    first = run_cli(args)
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.rmtree(data)  # D re-precomputed at the same path from 3 of the 4 raw shards (other_data)
    shutil.copytree(other_data, data)
    refused = run_cli(args)
    assert refused.returncode == 1, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert f"{out}/checkpoints/step-00000004 was trained on {data} (160 samples" in errors[0], errors
    assert f"but this run reads {data} (150 samples" in errors[0] and "allow_other_data" in errors[0], errors
    allowed = run_cli([*args, "--set", "checkpoint.allow_other_data=true"])
    assert allowed.returncode == 0, allowed.stderr[-3000:]
