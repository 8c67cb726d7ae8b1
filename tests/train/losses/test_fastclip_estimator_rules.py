"""FastCLIP's estimator rules from the authors' later work, each against a float64 oracle written from the
published formula: the DRRho-CLIP γ rule (``gamma_rule: drrho``; Optimization-AI/DRRho-CLIP README:
γ = min(1, 4.177·E^−0.7265), decayed from 1 over all E epochs with its cosine schedule) and SCENT's update
(``u_update: scent``; Optimization-AI/SCENT contrastive/scent.patch: the moving average with a per-sample
step γ_i = σ(U_i + γ_s), U_i the stored log(ε + u_i))."""

from __future__ import annotations

import math

import pytest
import torch
from fastclip_oracle import make_loss
from neuclip_oracle import log_g, unit_pairs
from safetensors.torch import load_file, save_file

from toolkit.core.config import build
from toolkit.train.config import TrainConfig
from toolkit.train.losses import LossConfig
from toolkit.train.losses.fastclip.config import FastCLIPConfig


def published_drrho_gamma(epoch: int, planned_epochs: int) -> float:
    """γ in epoch ``epoch`` of an E-epoch run: the README's final γ, reached by the reference's cosine
    adjust_gamma (1 in epoch 0) over gamma_decay_epochs = E, in float64."""
    final = min(1.0, 4.177 * planned_epochs**-0.7265)
    if epoch == 0:
        return 1.0
    if epoch >= planned_epochs:
        return final
    return 0.5 * (1 + math.cos(math.pi * epoch / planned_epochs)) * (1 - final) + final


@pytest.mark.parametrize("planned_epochs", [2, 7, 8, 30])
def test_drrho_gamma_per_epoch_equals_the_published_rule(planned_epochs):
    loss = make_loss("v3", 4, gamma_rule="drrho", gamma_decay_epochs=planned_epochs)
    got = []
    for epoch in range(planned_epochs + 2):
        loss.set_epoch(epoch)
        got.append(loss.gamma)
    want = [published_drrho_gamma(e, planned_epochs) for e in range(planned_epochs + 2)]
    assert got == pytest.approx(want, rel=1e-15, abs=0)
    if planned_epochs <= 7:  # 4.177·7^−0.7265 = 1.0155: no moving average at all up to 7 epochs
        assert got == [1.0] * len(got)
    if planned_epochs == 30:
        assert got[-1] == pytest.approx(0.3530, abs=1e-4)  # 4.177 / 30^0.7265 = 4.177 / 11.834


def test_drrho_decays_over_the_runs_planned_epochs():
    base = {"data": "/nonexistent/shards", "out": "/nonexistent/out"}
    cfg = build(
        TrainConfig, {**base, "epochs": 30, "loss": {"fastclip": {"gamma_rule": "drrho"}}}, source="t.yaml"
    )
    assert cfg.loss.fastclip.gamma_decay_epochs == 30
    given = {**base, "epochs": 30, "loss": {"fastclip": {"gamma_rule": "drrho", "gamma_decay_epochs": 12}}}
    assert build(TrainConfig, given, source="t.yaml").loss.fastclip.gamma_decay_epochs == 12
    with pytest.raises(
        ValueError, match="loss.fastclip.gamma_decay_epochs: gamma_rule: drrho needs the planned epochs"
    ):
        build(
            TrainConfig,
            {**base, "steps": 100, "loss": {"fastclip": {"gamma_rule": "drrho"}}},
            source="t.yaml",
        )
    default = build(
        TrainConfig, {**base, "loss": {"fastclip": {"gamma_rule": "drrho"}}}, source="t.yaml"
    )  # epochs' default
    assert default.loss.fastclip.gamma_decay_epochs == default.epochs == 1


def test_rules_are_refused_where_they_do_not_apply():
    with pytest.raises(ValueError, match="gamma_rule: drrho applies to FastCLIP"):
        LossConfig(kind="openclip", mode="gather", fastclip=FastCLIPConfig(gamma_rule="drrho"))
    for fields in (
        {"kind": "openclip", "mode": "gather"},
        {"kind": "fastclip", "fastclip": {"version": "v2"}},
    ):
        with pytest.raises(ValueError, match="u_update: scent applies to FastCLIP v0, v1 and v3"):
            build(LossConfig, {**fields, "fastclip": {**fields.get("fastclip", {}), "u_update": "scent"}})
    with pytest.raises(ValueError, match="u_update: scent replaces"):
        FastCLIPConfig(u_update="scent", gamma_rule="drrho")


class ScentOracle:
    """The patch's update in linear space, float64: first visit u = g, then γ_i = 1/(1 + e^{−log(u_i+ε) −
    γ_s}), u_i ← (1 − γ_i)·u_i + γ_i·g_i; with ``drift`` the old u's of the samples seen before first move by
    e^δ, δ = their mean log(g/u_old) (u_drift: batch)."""

    def __init__(self, eps: float, drift: bool = False):
        self.eps, self.drift, self.u = eps, drift, [{}, {}]

    def step(self, ids: list[int], gs: tuple[torch.Tensor, torch.Tensor], offset: float) -> None:
        for side, g in enumerate(gs):
            table, g = self.u[side], g.tolist()
            seen = [k for k, i in enumerate(ids) if i in table]
            shift = (
                sum(math.log(g[k] / table[ids[k]]) for k in seen) / len(seen) if self.drift and seen else 0.0
            )
            for k, i in enumerate(ids):
                if i not in table:
                    table[i] = g[k]
                    continue
                u_old = table[i] * math.exp(shift)
                step = 1.0 / (1.0 + math.exp(-math.log(u_old + self.eps) - offset))
                table[i] = (1 - step) * u_old + step * g[k]

    def value(self, ids: list[int], gs: tuple[torch.Tensor, torch.Tensor]) -> float:
        """v1's value: mean_i g1_i/(u1_i+ε) + g2_i/(u2_i+ε), with the updated u."""
        return sum(
            float(g[k]) / (self.u[side][i] + self.eps) for side, g in enumerate(gs) for k, i in enumerate(ids)
        ) / len(ids)


# (epoch, ids): ids repeat across steps and epochs; one epoch revisits a sample twice
SCENT_STEPS = [
    (0, [0, 1, 2, 3, 4]),
    (0, [5, 6, 7, 8, 9]),
    (1, [2, 5, 10, 0, 7, 11]),
    (1, [1, 2, 9, 12]),
    (2, [0, 1, 2, 3, 4, 5]),
    (3, [7, 2, 11, 13, 6]),
]


@pytest.mark.parametrize("schedule,drift", [("constant", False), ("cosine", False), ("constant", True)])
def test_scent_update_matches_the_published_formula(schedule, drift):
    eps, scent_gamma, decay = 0.05, 0.4, 3  # ε and γ_s where σ(log(u+ε) + γ_s) is far from 0 and 1
    loss = make_loss(
        "v1",
        14,
        table_dtype=torch.float64,
        u_update="scent",
        scent_gamma=scent_gamma,
        eps=eps,
        gamma_schedule=schedule,
        gamma_decay_epochs=decay,
        u_drift="batch" if drift else "none",
    )
    oracle, gen = ScentOracle(eps, drift), torch.Generator().manual_seed(4)
    a = torch.tensor(1 / 0.2, dtype=torch.float64)
    for epoch, ids in SCENT_STEPS:
        loss.set_epoch(epoch)
        # γ_s follows the γ schedule as in the patch (its γ slot): 1 in epoch 0, then towards scent_gamma
        offset = (
            1.0
            if epoch == 0
            else scent_gamma
            if schedule == "constant" or epoch >= decay
            else (0.5 * (1 + math.cos(math.pi * epoch / decay)) * (1 - scent_gamma) + scent_gamma)
        )
        assert loss.gamma == pytest.approx(offset, rel=1e-15)
        x, y = unit_pairs(len(ids), 4, gen)
        value = loss(x, y, a, torch.tensor(ids))
        gs = tuple(lg.exp() for lg in log_g(x, y, a))
        oracle.step(ids, gs, offset)
        assert float(value) == pytest.approx(oracle.value(ids, gs), rel=1e-12)
    for side, col in enumerate(("u_image", "u_text")):
        seen = sorted(oracle.u[side])
        want = torch.tensor([oracle.u[side][i] for i in seen], dtype=torch.float64)
        torch.testing.assert_close(loss.table(col)[seen], want, rtol=1e-12, atol=0)
        assert torch.isneginf(loss.table("log_" + col)[[i for i in range(14) if i not in seen]]).all()


def test_scent_steps_differ_from_the_moving_average():
    """The rule is live: the same batches give other tables than u ← (1−γ)u + γg at γ = γ_s-free γ_min."""
    tables = []
    for fields in ({"u_update": "scent", "scent_gamma": 0.4}, {"gamma_min": 0.4}):
        loss = make_loss("v1", 14, table_dtype=torch.float64, gamma_schedule="constant", **fields)
        gen = torch.Generator().manual_seed(4)
        for epoch, ids in SCENT_STEPS:
            loss.set_epoch(epoch)
            x, y = unit_pairs(len(ids), 4, gen)
            loss(x, y, torch.tensor(5.0, dtype=torch.float64), torch.tensor(ids))
        tables.append(loss.tables.data.clone())
    assert not torch.allclose(tables[0], tables[1], rtol=1e-6, atol=0)


def _scent_steps(loss, gen, epochs):
    out = []
    for epoch in epochs:
        loss.set_epoch(epoch)
        x = torch.nn.functional.normalize(torch.randn(5, 6, generator=gen), dim=1).requires_grad_()
        y = torch.nn.functional.normalize(torch.randn(5, 6, generator=gen), dim=1)
        v = loss(x, y, torch.tensor(30.0), torch.randperm(17, generator=gen)[:5])
        v.backward()
        out.append((v.detach(), x.grad))
    return out


@pytest.mark.parametrize("version", ["v1", "v3"])
def test_scent_tables_resume_exactly(tmp_path, version):
    kw = {"u_update": "scent", "scent_gamma": 2.0, "gamma_decay_epochs": 3, "rho": 6.5}
    first = make_loss(version, 17, **kw)
    _scent_steps(first, torch.Generator().manual_seed(1), [0, 1, 1])
    save_file(first.state_dict(), str(tmp_path / "fastclip.safetensors"))
    second = make_loss(version, 17, **kw)
    second.load_state_dict(load_file(str(tmp_path / "fastclip.safetensors")))
    torch.testing.assert_close(second.tables.data, first.tables.data, rtol=0, atol=0)
    a = _scent_steps(first, torch.Generator().manual_seed(2), [2, 3])
    b = _scent_steps(second, torch.Generator().manual_seed(2), [2, 3])
    for (va, ga), (vb, gb) in zip(a, b, strict=True):
        torch.testing.assert_close(vb, va, rtol=0, atol=0)
        torch.testing.assert_close(gb, ga, rtol=0, atol=0)
    torch.testing.assert_close(second.tables.data, first.tables.data, rtol=0, atol=0)
