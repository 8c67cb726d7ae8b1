"""FastCLIP's ``u_drift: batch``: before the moving average, the batch's old estimators move by their mean
log(g/u_old) (samples seen before only); checked in float64 against the definition."""

from __future__ import annotations

import math

import pytest
import torch
from neuclip_oracle import log_g, unit_pairs

from toolkit.core.config import build
from toolkit.train.losses import LossConfig, build_loss
from toolkit.train.losses.fastclip.config import FastCLIPConfig


def test_old_estimators_shift_by_the_batch_mean_drift_before_averaging():
    gen = torch.Generator().manual_seed(9)
    cfg = LossConfig(
        kind="fastclip",
        fastclip=FastCLIPConfig(version="v1", gamma_schedule="constant", gamma_min=0.5, u_drift="batch"),
    )
    loss = build_loss(cfg, data_size=10, table_dtype=torch.float64)
    a = torch.tensor(1 / 0.1, dtype=torch.float64)
    first, second = torch.arange(0, 6), torch.tensor([3, 4, 5, 6, 7, 8])  # 3, 4, 5 seen before; 6, 7, 8 new
    loss.begin_step(0, 2)  # epoch 0: γ = 1, u = g
    x, y = unit_pairs(6, 4, gen)
    loss(x, y, a, first)
    old = [loss.table(c).clone() for c in ("log_u_image", "log_u_text")]
    loss.end_step(True)
    loss.begin_step(2, 2)  # epoch 1: γ = 0.5
    x, y = unit_pairs(6, 4, gen)
    loss(x, y, a, second)
    seen = torch.tensor([True, True, True, False, False, False])
    for side, lg in enumerate(log_g(x, y, a)):
        col = ("log_u_image", "log_u_text")[side]
        u_old = old[side][second]
        shift = (lg - u_old)[seen].mean()
        want = torch.where(seen, torch.logaddexp(u_old + shift + math.log(0.5), lg + math.log(0.5)), lg)
        torch.testing.assert_close(loss.table(col)[second], want, rtol=1e-12, atol=1e-12)
        assert loss.metrics()[f"u_shift_{('image', 'text')[side]}"] == pytest.approx(float(shift), rel=1e-12)
    untouched = torch.tensor([0, 1, 2, 9])
    torch.testing.assert_close(loss.table("log_u_image")[untouched], old[0][untouched])


def test_u_drift_is_refused_where_there_is_no_global_estimator():
    for fields in (
        {"kind": "fastclip", "fastclip": {"version": "v2"}},
        {"kind": "neuclip"},
        {"kind": "openclip", "mode": "gather"},
    ):
        with pytest.raises(ValueError, match="u_drift: batch applies to FastCLIP v0, v1 and v3"):
            build(LossConfig, {**fields, "fastclip": {**fields.get("fastclip", {}), "u_drift": "batch"}})
