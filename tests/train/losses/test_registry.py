"""A new objective plugs in by subclassing ``TrainingLoss`` and registering its name: the class that
docs/architecture.md shows, trained through the real trainer with nothing else changed."""

from __future__ import annotations

import json

import pytest

from toolkit.train.losses import registry
from toolkit.train.losses.base import TrainingLoss
from toolkit.train.losses.config import LossConfig, loss_fields
from toolkit.train.losses.modes import contrastive_loss


class PlainCLIPLoss(TrainingLoss):
    """docs/architecture.md's worked example, verbatim."""

    def forward(self, x, y, logit_scale, index, logit_bias=None):
        share = contrastive_loss(
            x, y, logit_scale, mode="gather", group=self.group, check_sizes=self.check_sizes
        )
        self._last = share.detach()  # global_value(): the mean over ranks (TrainingLoss)
        return share


@pytest.fixture
def plain_registered(monkeypatch):
    monkeypatch.setattr(registry, "_SPECS", registry.specs())  # the built-ins; restored after the test
    registry.register("plain", f"{__name__}:PlainCLIPLoss")


def test_an_unregistered_kind_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="unknown loss kind 'plain'.*openclip"):
        LossConfig(kind="plain", mode="gather")
    with pytest.raises(ValueError, match="unknown loss 'plain'"):
        loss_fields("plain")


def test_a_registered_objective_trains_through_the_trainer(plain_registered, demo_train, tmp_path):
    from trainkit import train_cfg

    from toolkit.train.run import run

    assert loss_fields("plain") == {"kind": "plain"}
    out = tmp_path / "run"
    result = run(train_cfg(demo_train, out, steps=3, log_every=1, loss={"kind": "plain", "mode": "gather"}))
    assert result.counts["step"] == 3 and (out / "model").is_dir()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["loss"] > 0 for r in records)
    assert LossConfig(kind="plain", mode="gather").name == "plain"
