"""`toolkit eval zeroshot --model RUN` (the training run's folder instead of its RUN/model): the error names
the folder that holds the model."""

from __future__ import annotations

import pytest

from toolkit.models import CheckpointError, load_model, save_model


def test_a_run_folder_points_at_its_model(tmp_path):
    tiny = load_model("cliptk-tiny", seed=1)
    run = tmp_path / "run"
    save_model(tiny.model, tiny.model_cfg, run / "model")
    (run / "config.yaml").write_text("steps: 1\n")
    with pytest.raises(
        CheckpointError,
        match=r"run/open_clip_config.json: missing; a checkpoint directory needs "
        r".*; a training run's model is .*run/model$",
    ):
        load_model(str(run))
    assert load_model(str(run / "model")).model_cfg == tiny.model_cfg
