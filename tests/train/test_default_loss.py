"""The objective ``toolkit train`` picks when none is named: FastCLIP-v3 with ``u_drift: batch`` at every
batch size, γ decaying over all the planned epochs; a named loss, a loss kind in YAML/--set, or a preset
always wins."""

from __future__ import annotations

import pytest

from toolkit.core.config import build, to_dict
from toolkit.core.config_load import load_config
from toolkit.train.config import TrainConfig
from toolkit.train.losses.choice import DEFAULT_LOSS, default_loss, describe
from toolkit.train.losses.config import LossConfig, loss_fields
from toolkit.train.losses.fastclip.config import FastCLIPConfig

OPTION_DECAY_EPOCHS = FastCLIPConfig.__dataclass_fields__["gamma_decay_epochs"].default


def _recorded(record: dict, expected: dict) -> dict:
    """The keys of ``expected`` (sections key by key) as ``record`` holds them."""
    return {k: _recorded(record[k], v) if isinstance(v, dict) else record[k] for k, v in expected.items()}


def _cfg(**data) -> TrainConfig:
    return build(TrainConfig, {"data": "d", "out": "o", **data})


@pytest.mark.parametrize("batch", [2, 32, 64, 128, 129, 256, 4096])
@pytest.mark.parametrize("epochs", [1, 2, 6, 13, 24, 30, 100])
def test_one_objective_at_every_batch_with_gamma_over_the_planned_epochs(batch, epochs):
    """Every (batch, epochs) cell: drift-corrected v3, γ decaying from 1 to γ_min over all E epochs."""
    loss = _cfg(batch_size=batch, epochs=epochs).loss
    assert (loss.name, loss.mode, loss.fastclip.u_drift) == ("fastclip-v3", "fastclip", "batch")
    assert loss.fastclip.gamma_decay_epochs == epochs
    assert _recorded(to_dict(loss), default_loss(epochs)) == default_loss(epochs)


def test_the_rule_is_the_measured_one():
    """benchmarks/objectives/results/scratch.md and convergence_default.md measured exactly these fields."""
    assert default_loss(6) == {
        "kind": "fastclip",
        "tau_floor": 0.03,
        "fastclip": {"version": "v3", "u_drift": "batch", "gamma_decay_epochs": 6},
    }
    assert default_loss(None) == DEFAULT_LOSS  # planned by steps: the option's own decay
    assert _cfg().loss == build(LossConfig, default_loss(_cfg().epochs))


def test_a_run_planned_by_steps_keeps_the_options_decay():
    """A run planned by steps has no epoch count when the config is built: γ's option default applies."""
    loss = _cfg(batch_size=32, epochs=30, steps=500).loss
    assert loss == build(LossConfig, DEFAULT_LOSS)
    assert loss.fastclip.gamma_decay_epochs == OPTION_DECAY_EPOCHS


def test_given_knobs_keep_the_default_objective_and_their_own_decay():
    """Loss keys without a kind tune the default; an explicit decay or DRRho's γ rule is not overwritten
    (DRRho plans its own decay over all the epochs)."""
    tuned = _cfg(batch_size=32, epochs=10, loss={"rho": 3.0}).loss
    assert (tuned.name, tuned.rho, tuned.fastclip.gamma_decay_epochs) == ("fastclip-v3", 3.0, 10)
    own = _cfg(batch_size=32, epochs=30, loss={"fastclip": {"gamma_decay_epochs": 4}}).loss
    assert own.fastclip.gamma_decay_epochs == 4
    scent = _cfg(batch_size=64, epochs=30, loss={"fastclip": {"u_update": "scent"}}).loss
    assert (scent.name, scent.fastclip.u_update, scent.fastclip.gamma_decay_epochs) == (
        "fastclip-v3",
        "scent",
        30,
    )
    base = {"data": "d", "out": "o", "epochs": 30, "batch_size": 32}
    drrho = load_config(TrainConfig, None, [], {**base, "loss.fastclip.gamma_rule": "drrho"}, {}).loss
    assert (drrho.kind, drrho.fastclip.gamma_rule, drrho.fastclip.gamma_decay_epochs) == (
        "fastclip",
        "drrho",
        30,
    )
    tau = _cfg(batch_size=64, epochs=30, loss={"tau_init": 0.05}).loss
    assert (tau.name, tau.tau_init, tau.tau_floor) == ("fastclip-v3", 0.05, 0.03)
    floor = _cfg(batch_size=64, epochs=30, loss={"tau_floor": 0.01}).loss
    assert (floor.name, floor.tau_floor) == ("fastclip-v3", 0.01)  # open_clip's clamp, by hand
    low = _cfg(batch_size=64, epochs=30, loss={"tau_init": 0.02}).loss  # not raised to the floor at step 1
    assert (low.name, low.tau_init, low.tau_floor) == ("fastclip-v3", 0.02, 0.02)
    both = _cfg(batch_size=64, epochs=30, loss={"tau_init": 0.02, "tau_floor": 0.05}).loss
    assert (both.tau_init, both.tau_floor) == (0.02, 0.05)  # the user's own floor stays


def test_malformed_epochs_or_batch_are_reported_against_their_key():
    with pytest.raises(ValueError, match="batch_size"):
        _cfg(batch_size="many")
    with pytest.raises(ValueError, match="epochs"):
        _cfg(epochs="many")


def test_explicit_loss_or_preset_wins():
    for batch, epochs in ((32, 6), (32, 30), (64, 30), (256, 100)):
        # what `toolkit train --loss fastclip-v1 --epochs E --batch-size B` hands to the config loader
        explicit = {
            **{f"loss.{k}": v for k, v in loss_fields("fastclip-v1").items()},
            "data": "d",
            "out": "o",
            "epochs": epochs,
            "batch_size": batch,
        }
        cfg = load_config(TrainConfig, None, [], explicit, {})
        assert (cfg.loss.name, cfg.loss.fastclip.gamma_decay_epochs, cfg.loss.fastclip.u_drift) == (
            "fastclip-v1",
            OPTION_DECAY_EPOCHS,
            "none",
        )
        openclip = load_config(
            TrainConfig, None, [], {**explicit, "loss.kind": "openclip", "loss.fastclip.version": None}, {}
        )
        assert openclip.loss.kind == "openclip" and openclip.loss.learn_tau
        preset = _cfg(batch_size=batch, epochs=epochs, preset="cc3m").loss
        assert (preset.name, preset.rho, preset.fastclip.gamma_min, preset.fastclip.gamma_decay_epochs) == (
            "fastclip-v3",
            6.5,
            0.2,
            18,
        )
        assert _cfg(batch_size=batch, epochs=epochs, preset="cc3m-openclip").loss.kind == "openclip"
    set_kind = load_config(
        TrainConfig, None, ["loss.kind=fastclip", "epochs=30", "batch_size=32"], {"data": "d", "out": "o"}, {}
    ).loss
    assert (set_kind.fastclip.u_drift, set_kind.fastclip.gamma_decay_epochs) == ("none", OPTION_DECAY_EPOCHS)
    named = _cfg(batch_size=512, loss={"kind": "openclip"}).loss
    assert named.kind == "openclip" and named.fastclip.u_drift == "none"  # a named kind drops the rest


def test_help_describes_the_rule():
    from toolkit.cli.train import _loss_help

    assert describe() in _loss_help() and "planned epochs" in describe()
