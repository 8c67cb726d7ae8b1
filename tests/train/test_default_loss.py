"""The objective ``toolkit train`` picks when none is named follows the convergence evidence by batch size;
a named loss, a loss kind in YAML/--set, or a preset always wins."""

from __future__ import annotations

import pytest

from toolkit.core.config import build, to_dict
from toolkit.train.config import TrainConfig
from toolkit.train.losses.choice import BY_BATCH, default_loss, describe
from toolkit.train.losses.config import LossConfig


def _cfg(**data) -> TrainConfig:
    return build(TrainConfig, {"data": "d", "out": "o", **data})


@pytest.mark.parametrize("batch", [2, 32, 64, 128, 129, 256, 4096])
def test_default_objective_follows_the_table(batch):
    expected = default_loss(batch)
    loss = _cfg(batch_size=batch).loss
    assert {k: to_dict(loss)[k] for k in expected} == expected  # the table's keys as the config records them
    row = next(fields for largest, fields in BY_BATCH if largest is None or batch <= largest)
    assert expected == row


def test_measured_winner_is_the_default():
    """benchmarks/objectives/results/convergence.md: drift-corrected v3 at 32, 64 and 256 after 6 epochs."""
    for batch in (32, 64, 256):
        assert default_loss(batch) == {"kind": "fastclip", "version": "v3", "u_drift": "batch"}


def test_the_default_batch_gets_the_small_batch_objective():
    assert _cfg().loss == build(LossConfig, default_loss(64))


def test_named_objective_preset_and_other_loss_keys():
    assert _cfg(batch_size=32, loss={"kind": "fastclip", "version": "v1"}).loss.name == "fastclip-v1"
    assert _cfg(batch_size=512, loss={"kind": "openclip"}).loss.kind == "openclip"
    preset = _cfg(batch_size=32, preset="cc3m").loss  # a preset names its loss: it wins over the table
    assert (preset.name, preset.rho) == ("fastclip-v3", 6.5)
    assert _cfg(batch_size=32, preset="cc3m-openclip").loss.kind == "openclip"
    tuned = _cfg(batch_size=32, loss={"rho": 3.0}).loss  # other loss keys keep the table's objective
    assert {k: to_dict(tuned)[k] for k in default_loss(32)} == default_loss(32) and tuned.rho == 3.0
    assert _cfg(batch_size=32, loss={"kind": "openclip"}).loss.fastclip.u_drift == "none"  # a named kind drops the rest


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
