"""The trainer with FastCLIP's later estimator rules (docs/fastclip.md): ``gamma_rule: drrho`` takes E from
the run's planned epochs; ``u_update: scent`` trains with finite tables and saves them in its checkpoints."""

from __future__ import annotations

import math

import pytest
from safetensors.torch import load_file
from trainkit import metrics, train_cfg

from toolkit.train.run import run

STEPS_PER_EPOCH = 10  # 160 demo pairs, batch 16


def _gamma_by_epoch(out) -> dict[int, float]:
    return {int(r["epoch"]): r["gamma"] for r in metrics(out)}


def test_drrho_gamma_follows_the_runs_planned_epochs(demo_train, tmp_path):
    out, epochs = tmp_path / "run", 8
    cfg = train_cfg(
        demo_train,
        out,
        steps=0,
        epochs=epochs,
        log_every=STEPS_PER_EPOCH,
        loss={"gamma_rule": "drrho", "u_drift": "none"},
    )
    assert cfg.loss.fastclip.gamma_decay_epochs == epochs
    run(cfg)
    final = min(1.0, 4.177 * epochs**-0.7265)  # DRRho-CLIP README, E = 8: 0.922
    # a row logged at the last step of epoch e reports that epoch's γ
    for epoch, gamma in _gamma_by_epoch(out).items():
        want = 1.0 if epoch == 0 else 0.5 * (1 + math.cos(math.pi * epoch / epochs)) * (1 - final) + final
        assert gamma == pytest.approx(want, rel=1e-12), epoch


def test_scent_trains_and_checkpoints_its_tables(demo_train, tmp_path):
    out = tmp_path / "run"
    cfg = train_cfg(
        demo_train,
        out,
        steps=3 * STEPS_PER_EPOCH,
        log_every=1,
        checkpoint={"every_steps": 30},
        loss={"u_update": "scent", "scent_gamma": 0.5, "gamma_schedule": "constant", "u_drift": "none"},
    )
    result = run(cfg)
    assert result.counts["skipped_steps"] == 0
    rows = metrics(out)
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert {r["epoch"]: r["gamma"] for r in rows} == {
        0: 1.0,
        1: 0.5,
        2: 0.5,
    }  # γ_s: 1 in epoch 0, then scent_gamma
    tables = load_file(str(out / "checkpoints" / "step-00000030" / "loss_state.safetensors"))
    for side in ("image", "text"):
        log_u = tables[f"tables.log_u_{side}"]
        assert log_u.shape == (160,) and bool(log_u.isfinite().all()), side  # every sample visited, finite
