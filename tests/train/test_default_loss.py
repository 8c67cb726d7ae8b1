"""The objective ``toolkit train`` picks when none is named follows the convergence evidence by batch size;
a named loss, a loss kind in YAML/--set, or a preset always wins."""

from __future__ import annotations

import pytest

from toolkit.core.config import build, to_dict
from toolkit.core.config_load import load_config
from toolkit.train.config import TrainConfig
from toolkit.train.losses import choice
from toolkit.train.losses.choice import BY_BATCH, default_loss, describe
from toolkit.train.losses.config import LossConfig, loss_fields
from toolkit.train.losses.fastclip.config import FastCLIPConfig


def _recorded(record: dict, expected: dict) -> dict:
    """The keys of ``expected`` (sections key by key) as ``record`` holds them."""
    return {k: _recorded(record[k], v) if isinstance(v, dict) else record[k] for k, v in expected.items()}


def _cfg(**data) -> TrainConfig:
    return build(TrainConfig, {"data": "d", "out": "o", **data})


@pytest.mark.parametrize("batch", [2, 32, 64, 128, 129, 256, 4096])
def test_default_objective_follows_the_table(batch):
    expected = default_loss(batch)
    loss = _cfg(batch_size=batch).loss
    assert _recorded(to_dict(loss), expected) == expected  # the table's keys as the config records them
    row = next(fields for largest, fields in BY_BATCH if largest is None or batch <= largest)
    assert expected == row


def test_measured_winner_is_the_default():
    """benchmarks/objectives/results/convergence.md: drift-corrected v3 at 32, 64 and 256 after 6 epochs."""
    for batch in (32, 64, 256):
        assert default_loss(batch) == {"kind": "fastclip", "fastclip": {"version": "v3", "u_drift": "batch"}}


def test_the_default_batch_gets_the_small_batch_objective():
    assert _cfg().loss == build(LossConfig, default_loss(64))


def test_named_objective_preset_and_other_loss_keys():
    assert (
        _cfg(batch_size=32, loss={"kind": "fastclip", "fastclip": {"version": "v1"}}).loss.name
        == "fastclip-v1"
    )
    assert _cfg(batch_size=512, loss={"kind": "openclip"}).loss.kind == "openclip"
    preset = _cfg(batch_size=32, preset="cc3m").loss  # a preset names its loss: it wins over the table
    assert (preset.name, preset.rho) == ("fastclip-v3", 6.5)
    assert _cfg(batch_size=32, preset="cc3m-openclip").loss.kind == "openclip"
    tuned = _cfg(batch_size=32, loss={"rho": 3.0}).loss  # other loss keys keep the table's objective
    assert _recorded(to_dict(tuned), default_loss(32)) == default_loss(32) and tuned.rho == 3.0
    assert (
        _cfg(batch_size=32, loss={"kind": "openclip"}).loss.fastclip.u_drift == "none"
    )  # a named kind drops the rest


def test_malformed_batch_is_reported_against_its_key():
    with pytest.raises(ValueError, match="batch_size"):
        _cfg(batch_size="many")


def test_table_is_complete_and_described():
    assert BY_BATCH[-1][0] is None
    bounds = [b for b, _ in BY_BATCH[:-1]]
    assert bounds == sorted(bounds)
    for _, fields in BY_BATCH:
        build(LossConfig, fields)  # every row is a valid objective
    assert describe().endswith("at every batch" if len(BY_BATCH) == 1 else "above")


# ---------------------------------------------------------------- by batch and planned epochs (issue 33)


# 30 epochs: OpenCLIP with τ learned slowly at batch 32 and 64 (convergence.md, convergence_gamma.md), the
# drift-corrected v3 at 256 (convergence_gamma.md)
OPENCLIP_SLOW_TAU = {"kind": "openclip", "mode": "gather", "learn_tau": True, "lr_tau": 1e-4}
LONG_CELLS = {
    32: OPENCLIP_SLOW_TAU,
    64: OPENCLIP_SLOW_TAU,
    256: {"kind": "fastclip", "fastclip": {"version": "v3", "u_drift": "batch", "gamma_decay_epochs": 15}},
}


def _row(table, batch):
    return next(fields for largest, fields in table if largest is None or batch <= largest)


@pytest.mark.parametrize("batch", [32, 64, 256, 4096])
@pytest.mark.parametrize(
    "epochs", [None, 1, 2, 6, choice.SHORT_EPOCHS_MAX, choice.SHORT_EPOCHS_MAX + 1, 30, 100]
)
def test_choice_per_batch_and_epochs_cell(batch, epochs):
    """Each (batch, epochs) cell gets its table's row; FastCLIP's γ decays over the benchmarked share of the
    planned epochs (none planned, or one epoch: the option's default is left alone)."""
    long_run = epochs is not None and epochs > choice.SHORT_EPOCHS_MAX
    row = _row(choice.BY_BATCH_LONG if long_run else choice.BY_BATCH, batch)
    fields = default_loss(batch, epochs)
    section, row_section = fields.get("fastclip", {}), row.get("fastclip", {})
    assert {**fields, "fastclip": {k: v for k, v in section.items() if k != "gamma_decay_epochs"}} == {
        **row,
        "fastclip": row_section,
    }
    if (
        row["kind"] == "fastclip"
        and epochs is not None
        and epochs > 1
        and row_section.get("gamma_rule") != "drrho"
    ):
        assert section["gamma_decay_epochs"] == max(1, round(epochs * 18 / 37))
    else:
        assert "gamma_decay_epochs" not in section or "gamma_decay_epochs" in row_section
    cfg = _cfg(batch_size=batch, **({} if epochs is None else {"epochs": epochs})).loss
    assert cfg == build(LossConfig, default_loss(batch, epochs if epochs is not None else 1))


def test_measured_cells():
    """The cells the convergence benchmark measured (benchmarks/objectives/results/convergence.md and
    convergence_gamma.md): 6 epochs at batch 32, 64, 256 and 30 epochs at batch 32, 64 and 256."""
    for batch in (32, 64, 256):
        assert default_loss(batch, 6) == {
            "kind": "fastclip",
            "fastclip": {"version": "v3", "u_drift": "batch", "gamma_decay_epochs": 3},
        }
    for batch, fields in LONG_CELLS.items():
        assert default_loss(batch, 30) == fields
    loss = _cfg(batch_size=64, epochs=30).loss  # what `toolkit train --epochs 30 --batch-size 64` builds
    assert (loss.kind, loss.mode, loss.learn_tau, loss.lr_tau, loss.tau_init) == (
        "openclip",
        "gather",
        True,
        1e-4,
        0.07,
    )
    loss = _cfg(batch_size=256, epochs=30).loss
    assert (loss.name, loss.fastclip.u_drift, loss.fastclip.gamma_min, loss.fastclip.gamma_decay_epochs) == (
        "fastclip-v3",
        "batch",
        0.2,
        15,
    )


def test_steps_planned_run_uses_the_short_table():
    """A run planned by steps has no epoch count when the config is built: the short-run row, γ untouched."""
    cfg = _cfg(batch_size=32, epochs=30, steps=500).loss
    assert cfg == build(LossConfig, default_loss(32))


def test_explicit_loss_or_preset_wins_at_every_cell():
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
        assert (
            cfg.loss.name == "fastclip-v1"
            and cfg.loss.fastclip.gamma_decay_epochs == 18
            and cfg.loss.fastclip.u_drift == "none"
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
    assert (
        set_kind.fastclip.u_drift == "none" and set_kind.fastclip.gamma_decay_epochs == 18
    )  # --set loss.kind: the option defaults


def test_help_names_both_regimes():
    text = describe()
    if choice.BY_BATCH_LONG != choice.BY_BATCH:
        assert f"more than {choice.SHORT_EPOCHS_MAX} planned epochs" in text
    from toolkit.cli.train import _loss_help

    assert "planned epochs" in _loss_help() and text in _loss_help()


def test_fastclip_knobs_without_a_kind_keep_fastclip_in_a_long_run():
    """`--set loss.u_update=scent --epochs 30` asks for FastCLIP: the short table's FastCLIP row, not OpenCLIP
    (which would refuse or ignore the knob); DRRho's rule still plans its decay over all the epochs."""
    scent = _cfg(batch_size=64, epochs=30, loss={"fastclip": {"u_update": "scent"}}).loss
    assert (
        scent.name,
        scent.fastclip.u_drift,
        scent.fastclip.u_update,
        scent.fastclip.gamma_decay_epochs,
    ) == ("fastclip-v3", "batch", "scent", 15)
    drrho = _cfg(batch_size=64, epochs=30, loss={"fastclip": {"gamma_rule": "drrho"}}).loss
    assert (drrho.kind, drrho.fastclip.gamma_rule, drrho.fastclip.gamma_decay_epochs) == (
        "fastclip",
        "drrho",
        30,
    )
    assert (
        _cfg(batch_size=64, epochs=30, loss={"tau_init": 0.05}).loss.kind == "openclip"
    )  # not FastCLIP's own
    for knob in choice.FASTCLIP_KNOBS - {"fastclip"}:
        assert knob in LossConfig.__dataclass_fields__ or knob in FastCLIPConfig.__dataclass_fields__, knob


def test_fastclip_knobs_in_their_section_pick_fastclip_for_long_runs():
    """A FastCLIP knob in ``loss.fastclip`` without a kind asks for FastCLIP at any epochs; DRRho's γ rule
    then plans its decay over all the epochs."""
    base = {"data": "d", "out": "o", "epochs": 30, "batch_size": 32}
    for key, value in (("loss.fastclip.gamma_rule", "drrho"), ("loss.fastclip.u_drift", "batch")):
        one = load_config(TrainConfig, None, [], {**base, key: value}, {}).loss
        assert one.kind == "fastclip"
    drrho = load_config(TrainConfig, None, [], {**base, "loss.fastclip.gamma_rule": "drrho"}, {}).loss
    assert drrho.fastclip.gamma_decay_epochs == 30
    assert load_config(TrainConfig, None, [], base, {}).loss.kind == "openclip"  # no knob: the long-run table
