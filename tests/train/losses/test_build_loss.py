"""``build_loss`` and the ``TrainingLoss`` interface every objective shares (one process)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.functional import normalize

from toolkit.core.config import ConfigError, build
from toolkit.kernels.naive import clip_loss
from toolkit.train.losses import LossConfig, build_loss, loss_fields
from toolkit.train.losses.fastclip.config import FastCLIPConfig
from toolkit.train.losses.modes import MODES
from toolkit.train.losses.registry import loss_names


def _batch(b: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = normalize(torch.randn(b, d, generator=g, dtype=torch.float64), dim=1)
    y = normalize(x + torch.randn(b, d, generator=g, dtype=torch.float64), dim=1)
    return x, y


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("b", [1, 5])
def test_openclip_in_every_mode_is_the_clip_loss(mode, b):
    x, y = _batch(b, 6, b)
    xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
    p = torch.tensor(math.log(1 / 0.07), dtype=torch.float64, requires_grad=True)
    loss = build_loss(build(LossConfig, {"kind": "openclip", "mode": mode}))
    share = loss(xs, ys, p.exp(), torch.arange(b))
    share.backward()
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    pr = p.detach().clone().requires_grad_()
    ref = clip_loss(xr, yr, pr.exp())
    ref.backward()
    torch.testing.assert_close(share, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(loss.global_value(), ref.detach(), rtol=1e-10, atol=1e-12)
    for got, want in ((xs.grad, xr.grad), (ys.grad, yr.grad), (p.grad, pr.grad)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    assert loss.temperature(p.exp()) == pytest.approx(0.07)
    assert loss.state_dict() == {}  # no per-sample state


@pytest.mark.parametrize("name", tuple(loss_names()))
def test_every_objective_builds_steps_and_reports(name):
    cfg = build(LossConfig, {**loss_fields(name), "tau_init": 0.05})
    loss = build_loss(cfg, data_size=20, table_dtype=torch.float64)
    loss.begin_step(7, 4)
    x, y = _batch(6, 5, 3)
    xs = x.clone().requires_grad_()
    p = torch.tensor(math.log(1 / 0.05), dtype=torch.float64, requires_grad=True)
    # an objective that reads a reference model's features gets them as the trainer passes them (base.py)
    reference = {"reference": (x[:, :3].float(), y[:, :3].float())} if type(loss).reads_reference else {}
    share = loss(xs, y, p.exp(), torch.tensor([3, 1, 4, 15, 9, 2]), **reference)
    share.backward()
    assert torch.isfinite(share) and torch.isfinite(xs.grad).all()
    assert torch.equal(loss.global_value(), share.detach())  # one rank: its share is the global value
    assert (p.grad is not None) == (cfg.learns_logit_scale or cfg.kind == "openclip")
    assert 0.0 < loss.temperature(p.exp()) <= 1.0
    if cfg.kind == "fastclip":  # per-sample state round-trips through state_dict
        other = build_loss(cfg, data_size=20, table_dtype=torch.float64)
        other.load_state_dict(loss.state_dict())
        assert torch.equal(other.tables.data, loss.tables.data)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="fastclip mode only"):
        build(LossConfig, {"kind": "fastclip", "mode": "gather"}, source="run.yaml", prefix="loss")
    with pytest.raises(ConfigError, match="loss.version"):
        build(LossConfig, {"version": "v4"}, source="run.yaml", prefix="loss")
    with pytest.raises(ConfigError, match="tau_beta1 must be < 1"):
        build(LossConfig, {"fastclip": {"tau_beta1": 1.0}})
    with pytest.raises(ValueError, match="data_size"):
        build_loss(LossConfig())
    with pytest.raises(ValueError, match="choose one of"):
        loss_fields("fastclip-v9")
    assert loss_fields("fastclip-v2") == {"kind": "fastclip", "fastclip": {"version": "v2"}}
    assert LossConfig(kind="openclip", learn_tau=False).learns_logit_scale is False
    assert [
        LossConfig(fastclip=FastCLIPConfig(version=v)).learns_logit_scale for v in ("v0", "v1", "v2", "v3")
    ] == [True, False, False, True]
