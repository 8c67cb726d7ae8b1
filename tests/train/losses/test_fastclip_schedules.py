"""γ schedules (epoch and per-step) and the temperature control (step_thresh lr, clamp)."""

from __future__ import annotations

import math

import pytest
import torch
from fastclip_oracle import make_loss

from toolkit.train.losses.fastclip.schedules import gamma_at_epoch, gamma_at_step
from toolkit.train.losses.temperature import TemperatureControl


def test_gamma_cosine_and_constant_by_epoch():
    # values written out from the reference's adjust_gamma for γ_min = 0.2 over 4 epochs
    want = [1.0] + [0.5 * (1 + math.cos(math.pi * e / 4)) * 0.8 + 0.2 for e in (1, 2, 3)] + [0.2, 0.2]
    assert [gamma_at_epoch(e, 0.2, 4, "cosine") for e in range(6)] == pytest.approx(want, abs=1e-15)
    assert gamma_at_epoch(2, 0.2, 4, "cosine") == pytest.approx(0.6)
    assert [gamma_at_epoch(e, 0.2, 4, "constant") for e in range(3)] == [1.0, 0.2, 0.2]


def test_gamma_per_step_cosine():
    spe = 10
    assert gamma_at_step(9, spe, 0.2, 4, "cosine_step") == 1.0  # epoch 0 fills the tables
    for epoch in range(1, 6):  # equals the epoch schedule at epoch boundaries
        assert gamma_at_step(epoch * spe, spe, 0.2, 4, "cosine_step") == pytest.approx(
            gamma_at_epoch(epoch, 0.2, 4, "cosine")
        )
    inside = [gamma_at_step(s, spe, 0.2, 4, "cosine_step") for s in range(spe, 4 * spe + 1)]
    assert all(a > b for a, b in zip(inside, inside[1:], strict=False))  # strictly decreasing
    assert gamma_at_step(15, spe, 0.2, 4, "cosine") == gamma_at_epoch(1, 0.2, 4, "cosine")  # per epoch


def test_loss_begin_step_changes_gamma_within_an_epoch_only_for_step_schedule():
    loss = make_loss("v1", 4, gamma_min=0.2, gamma_decay_epochs=4, gamma_schedule="cosine_step")
    loss.begin_step(15, 10)
    assert loss.gamma == pytest.approx(gamma_at_step(15, 10, 0.2, 4, "cosine_step"))
    assert gamma_at_epoch(1, 0.2, 4, "cosine") > loss.gamma > gamma_at_epoch(2, 0.2, 4, "cosine")


def test_step_thresh_lr_and_clamp():
    p = torch.nn.Parameter(torch.tensor(math.log(1 / 0.05)))
    group = {"params": [p], "lr": 0.0}
    ctl = TemperatureControl(p, group, lr_tau=2e-4, schedule="step_thresh")
    assert ctl.before_step(0) == pytest.approx(2e-4)
    with torch.no_grad():
        p.fill_(math.log(1 / 0.029))  # τ ≤ 0.03 divides lr_tau by 3
    assert ctl.before_step(1) == pytest.approx(2e-4 / 3)
    with torch.no_grad():
        p.fill_(math.log(1 / 0.04))  # back above: re-evaluated every step, as in the reference
    assert ctl.before_step(2) == pytest.approx(2e-4)
    with torch.no_grad():
        p.fill_(5.0)
    ctl.after_step()
    assert float(p.detach()) == pytest.approx(math.log(100.0))
    with torch.no_grad():
        p.fill_(-1.0)
    ctl.after_step()
    assert float(p.detach()) == 0.0


def test_cosine_and_const_tau_lr():
    p = torch.nn.Parameter(torch.tensor(3.0))
    g = {"params": [p], "lr": 0.0}
    cos = TemperatureControl(p, g, lr_tau=1.0, schedule="cosine", warmup_steps=4, total_steps=14)
    assert [cos.lr_at(s) for s in (0, 3)] == pytest.approx([0.25, 1.0])
    assert cos.lr_at(9) == pytest.approx(0.5)
    assert TemperatureControl(p, g, lr_tau=0.3, schedule="const").lr_at(100) == 0.3
    with pytest.raises(ValueError, match="schedule"):
        TemperatureControl(p, g, lr_tau=0.3, schedule="linear")


class _ScaleOnly(torch.nn.Module):
    """A model with only a logit scale, as the trainer's Update sees one."""

    def __init__(self, tau: float):
        super().__init__()
        self.logit_scale = torch.nn.Parameter(torch.tensor(math.log(1 / tau)))


class _NoSchedules:
    """The objective hooks Update calls, for a loss with no state of its own."""

    def begin_step(self, step: int, steps_per_epoch: int) -> None:
        pass

    def end_step(self, applied: bool) -> None:
        pass


@pytest.mark.parametrize("tau_floor", [0.01, 0.05])
def test_tau_floor_holds_a_learned_tau_through_the_trainers_update(tau_floor):
    """loss.tau_floor: a gradient that pushes τ down at every step (Adam at lr 0.5) stops at the floor,
    through the trainer's own Update (optimiser, τ group, clamp after each step); 0.01 is open_clip's
    clamp."""
    from toolkit.core.config import build
    from toolkit.train.config import OptimConfig
    from toolkit.train.losses.config import LossConfig
    from toolkit.train.update import Update

    model = _ScaleOnly(tau=0.07)
    loss = build(LossConfig, {"tau_floor": tau_floor, "lr_tau": 0.5, "lr_tau_schedule": "const"})
    update = Update(model, _NoSchedules(), OptimConfig(lr=0.5, weight_decay=0.0), loss, total_steps=40)
    for step in range(40):
        update.begin(step, 40)
        value = -model.logit_scale  # lower is better at a larger scale: τ falls every step
        value.backward()
        assert update.finish(value.detach()).applied
    assert math.exp(-float(model.logit_scale.detach())) == pytest.approx(tau_floor, rel=1e-6)
