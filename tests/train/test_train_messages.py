"""What `toolkit train` says (issue 25 item 5): --help explains --steps 0, an unused --master-port is
reported, and --quiet silences torchrun's banner and every INFO line of a two-process run."""

from __future__ import annotations

import logging
import re

import pytest
from trainkit import run_cli, train_cfg


def test_help_says_what_steps_0_means():
    from typer.testing import CliRunner

    from toolkit.cli.main import app

    result = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    text = re.sub(r"[\s│]+", " ", result.output)
    # the help is the config field's doc (toolkit train's options are generated from TrainConfig)
    assert (
        "0 (default): epochs x steps per epoch, which is train_num_samples (or the dataset's size) // "
        "batch_size" in text
    ), text


def test_a_master_port_given_to_one_process_is_reported_as_unused(demo_train, tmp_path, caplog):
    from toolkit.train.run import preflight

    with caplog.at_level(logging.WARNING, logger="toolkit"):
        preflight(train_cfg(demo_train, tmp_path / "run", launch={"master_port": 29555}))
    assert "--master-port 29555 is unused: one process needs no rendezvous" in caplog.text


@pytest.mark.dist
# slow: by default test_launch.py::test_nproc_per_node_2_equals_one_process[fastclip-v3] runs --quiet
@pytest.mark.slow
def test_quiet_silences_torchrun_and_the_workers(demo_train, tmp_path):
    result = run_cli(
        [
            "--quiet",
            "train",
            "--data",
            str(demo_train),
            "--out",
            str(tmp_path / "run"),
            "--steps",
            "2",
            "--batch-size",
            "16",
            "--workers",
            "0",
            "--nproc-per-node",
            "2",
            "--set",
            "tensorboard=false",
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == "", result.stderr[
        -3000:
    ]  # no banner (OMP_NUM_THREADS), no INFO line of any process
    assert "2 steps, 32 samples on 2 rank(s)" in result.stdout


def test_an_elastic_job_with_a_global_batch_larger_than_the_data_is_refused_before_launch(
    demo_train, tmp_path
):
    """nodes MIN:MAX: the world size (and so the divisibility check) waits for rendezvous, but a global batch
    larger than the data fails at any world size, so the preflight refuses it before any process starts."""
    import json

    from toolkit.train.run import preflight

    num_samples = json.loads((demo_train / "dataset.json").read_text())["num_samples"]
    cfg = train_cfg(demo_train, tmp_path / "run", batch_size=num_samples + 1, launch={"nodes": "1:2"})
    with pytest.raises(ValueError, match=r"is larger than the dataset"):
        preflight(cfg)
    assert not (tmp_path / "run").exists()
