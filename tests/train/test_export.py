"""toolkit export RUN --out DIR: open_clip loads DIR offline (local-dir:) and gives the run's features."""

from __future__ import annotations

import json

import torch
from trainkit import run_cli, train_cfg

from toolkit.train.run import run


def _probe(clip, model_cfg, preprocess_cfg, step):  # an evaluation callback: a real number of the model
    with torch.no_grad():
        return {"eval/probe/logit_scale": float(clip.logit_scale.exp())}


def test_export_loads_offline_in_open_clip_with_the_same_features(demo_train, tmp_path):
    import open_clip

    from toolkit.models.factory import load_model
    from toolkit.models.registry import tokenizer

    out = tmp_path / "run"
    run(
        train_cfg(
            demo_train,
            out,
            steps=2,
            ema_decay=0.5,
            eval={"every_steps": 2, "root": str(tmp_path), "datasets": ["probe"]},
        ),
        eval_fn=_probe,
    )
    for weights, folder in (("raw", "model"), ("ema", "model-ema")):
        shared = tmp_path / f"shared-{weights}"
        result = run_cli(["export", str(out), "--out", str(shared), "--weights", weights])
        assert result.returncode == 0, result.stderr
        model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{shared}")
        tok = open_clip.get_tokenizer(f"local-dir:{shared}")
        ours = load_model(f"local-dir:{out / folder}")
        texts = ["dog face", "woman scientist", "red apple"]
        assert torch.equal(tok(texts), tokenizer(f"local-dir:{out / folder}")(texts))
        image = torch.rand(2, 3, *model.visual.image_size, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert torch.equal(model.eval().encode_image(image), ours.model.eval().encode_image(image))
            assert torch.equal(model.encode_text(tok(texts)), ours.model.encode_text(tok(texts)))
        card = json.loads((shared / "model_card.json").read_text())
        assert card["dataset"]["num_samples"] == 160 and card["dataset"]["fingerprint"].startswith(
            "manifest:"
        )
        assert card["training"]["step"] == 2 and card["config"]["ema_decay"] == 0.5
        assert card["evaluation"]["eval/probe/logit_scale"]["step"] == 2
        assert "eval_ema/probe/logit_scale" in card["evaluation"]
        assert "## Training config" in (shared / "README.md").read_text()


def test_export_refuses_what_is_not_a_finished_run(tmp_path):
    result = run_cli(["export", str(tmp_path), "--out", str(tmp_path / "x")])
    assert result.returncode == 1 and "not a finished training run" in result.stderr
    assert not (tmp_path / "x").exists()
