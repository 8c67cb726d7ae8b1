"""How the towers run (train/towers.py): activation checkpointing, locked towers, torch.compile."""

from __future__ import annotations

import pytest
import torch
from trainkit import MODEL, metrics, train_cfg, weights

from toolkit.train.run import run

SGD = {"optim": {"name": "sgd", "lr": 0.1}}  # linear in the gradient: summation-order noise stays small


def _rel(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-12)).item() for k in want)


@pytest.mark.parametrize("micro", [0, 5])  # 5: the gradient cache's second pass is checkpointed
def test_grad_checkpointing_trains_the_same_weights(demo_train, tmp_path, micro):
    run(train_cfg(demo_train, tmp_path / "plain", steps=3, micro_batch_size=micro, **SGD))
    run(train_cfg(demo_train, tmp_path / "ckpt", steps=3, micro_batch_size=micro, grad_checkpointing=True, **SGD))
    assert _rel(weights(tmp_path / "ckpt"), weights(tmp_path / "plain")) <= 1e-6


def test_grad_checkpointing_is_on_in_both_towers():
    from toolkit.models.factory import build_model, resolve_spec
    from toolkit.train.towers import set_grad_checkpointing

    clip = build_model(resolve_spec(MODEL).model_cfg)
    set_grad_checkpointing(clip)
    assert clip.visual.transformer.grad_checkpointing and clip.transformer.grad_checkpointing


def test_plan_predicts_the_checkpointed_activations():
    from toolkit.core.config import build
    from toolkit.train.plan import MEASURED, MEASURED_CHECKPOINTED, PlanConfig, run

    def activations(ckpt: bool) -> float:
        plan = run(build(PlanConfig, {"model": MODEL, "batch_size": 256, "micro_batch_size": 64, "device": "cpu",
                                      "grad_checkpointing": ckpt}))
        return plan.rows["activations (micro-batch 64)"]

    fixed, per_sample, _ = MEASURED_CHECKPOINTED[(MODEL, "fp32", "cpu")]
    assert activations(True) == fixed + 64 * per_sample
    fixed, per_sample, _ = MEASURED[(MODEL, "fp32", "cpu")]
    assert activations(False) == fixed + 64 * per_sample
    assert activations(False) >= 2 * activations(True)  # benchmarks/grad_checkpointing.py's measured saving
