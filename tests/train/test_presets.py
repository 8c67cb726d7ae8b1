"""Preset configs and ``toolkit train presets``."""

from __future__ import annotations

import yaml
from typer.testing import CliRunner

from toolkit.cli.main import app
from toolkit.core.config import build, to_dict
from toolkit.train.losses import build_loss
from toolkit.train.presets import Preset, get_preset
from toolkit.train.presets import presets as _presets


def test_presets_match_published_settings():
    cc3m, cc12m, laion = _presets()["cc3m"], _presets()["cc12m"], _presets()["laion"]
    assert (cc3m.model, cc3m.batch_size, cc3m.optim.lr, cc3m.optim.weight_decay, cc3m.optim.warmup_steps) == (
        "RN50",
        1024,
        1e-3,
        0.1,
        10000,
    )
    assert (
        cc3m.loss.lr_tau,
        cc3m.loss.rho,
        cc3m.loss.fastclip.gamma_min,
        cc3m.loss.fastclip.gamma_decay_epochs,
        cc3m.loss.lr_tau_schedule,
    ) == (2e-4, 6.5, 0.2, 18, "step_thresh")
    assert (cc12m.model, cc12m.batch_size, cc12m.optim.lr, cc12m.loss.lr_tau, cc12m.loss.rho) == (
        "ViT-B-32",
        2048,
        4e-4,
        1e-4,
        8.5,
    )
    assert (
        cc12m.loss.fastclip.gamma_min,
        cc12m.loss.fastclip.gamma_decay_epochs,
        cc12m.optim.beta2,
        cc12m.optim.eps,
    ) == (0.2, 16, 0.98, 1e-6)
    assert (laion.model, laion.batch_size, laion.optim.lr, laion.optim.lr_min, laion.optim.weight_decay) == (
        "ViT-B-16",
        5120,
        2e-4,
        4e-5,
        0.2,
    )
    assert (
        laion.loss.lr_tau,
        laion.loss.rho,
        laion.loss.fastclip.gamma_min,
        laion.loss.fastclip.gamma_decay_epochs,
        laion.loss.eps,
    ) == (5e-5, 16.0, 0.8, 10, 1e-6)
    for preset in _presets().values():  # every preset is a valid typed config
        assert build(Preset, to_dict(preset)) == preset


def test_preset_builds_loss_and_optimizer_config():
    loss = build_loss(get_preset("cc3m-v2").loss, data_size=50)
    assert (
        loss.version == "v2"
        and loss.cfg.lr_tau == 0.0133
        and abs(float(loss.table("tau_image")[0]) - 0.03) < 1e-8
    )
    assert get_preset("cc12m").loss.lr_tau == 1e-4 and get_preset("cc12m").loss.learns_logit_scale
    assert get_preset("cc3m-v1").loss.lr_tau is None and not get_preset("cc3m-v1").loss.learns_logit_scale
    assert get_preset("cc3m-openclip").train_overrides()["loss"]["kind"] == "openclip"


def test_cli_lists_and_prints_presets():
    listing = CliRunner().invoke(app, ["train", "presets"])
    assert listing.exit_code == 0
    assert all(name in listing.output for name in ("cc3m", "cc12m", "laion"))
    one = CliRunner().invoke(app, ["train", "presets", "cc12m"])
    assert one.exit_code == 0
    assert yaml.safe_load(one.output) == to_dict(_presets()["cc12m"])
    bad = CliRunner().invoke(app, ["train", "presets", "cc13m"])
    assert bad.exit_code == 2 and "known presets" in bad.output
