"""FastCLIPLoss against the float64 oracle of the reference (tests/train/fastclip_oracle.py), and the oracle
itself."""

from __future__ import annotations

import math

import pytest
import torch
from fastclip_oracle import Oracle, make_batch, make_loss

from toolkit.train.losses.fastclip.schedules import gamma_at_epoch

N, D = 13, 7
SETTINGS = {"rho": 6.5, "eps": 1e-14}
V2 = {"tau_init": 0.07, "lr_tau": 0.05, "tau_beta1": 0.9, "tau_beta2": 0.98, "tau_eps": 1e-6}


def _ids(gen, epoch, b):
    """Epoch 0 visits only ids < 9: ids 9..12 are first seen while γ < 1 (the reset rule)."""
    pool = 9 if epoch == 0 else N
    return torch.randperm(pool, generator=gen)[:b]


def _compare_tables(loss, oracle, version):
    u = {"image": oracle.u_im, "text": oracle.u_tt}
    for side in ("image", "text"):
        seen = u[side] > 0
        torch.testing.assert_close(loss.table(f"u_{side}")[seen], u[side][seen], rtol=1e-10, atol=0)
        assert torch.isneginf(loss.table(f"log_u_{side}")[~seen]).all()
    if version == "v2":
        short = {"image": "im", "text": "tt"}
        for name in ("tau", "bound", "m", "v"):
            for side in ("image", "text"):
                want = getattr(oracle, f"{name}_{short[side]}")
                torch.testing.assert_close(loss.table(f"{name}_{side}"), want, rtol=1e-9, atol=1e-12)


def run_scenario(version, batch_sizes=(6, 5, 6, 2, 6, 4, 6, 3), steps_per_epoch=2, gamma_schedule="cosine"):
    """Several epochs (γ = 1, then decaying), unseen and revisited ids, odd batch sizes; every step
    compares value, feature grads, p grad and the tables with the oracle."""
    kw = dict(SETTINGS, **(V2 if version == "v2" else {}))
    loss = make_loss(
        version,
        N,
        gamma_min=0.3,
        gamma_decay_epochs=2,
        gamma_schedule=gamma_schedule,
        table_dtype=torch.float64,
        **kw,
    )
    oracle = Oracle(
        version,
        N,
        rho=kw["rho"],
        eps=kw["eps"],
        **(
            {"tau_init": 0.07, "lr_tau": 0.05, "beta1": 0.9, "beta2": 0.98, "eps_tau": 1e-6}
            if version == "v2"
            else {}
        ),
    )
    gen = torch.Generator().manual_seed(hash(version) % 1000)
    for step, b in enumerate(batch_sizes):
        epoch = step // steps_per_epoch
        loss.set_epoch(epoch)
        oracle.set_epoch(epoch, gamma_at_epoch(epoch, 0.3, 2, gamma_schedule))
        assert loss.gamma == oracle.gamma
        x, y = make_batch(gen, b, D)
        idx = _ids(gen, epoch, b)
        p = torch.tensor(math.log(1 / 0.05) + 0.1 * step, dtype=torch.float64)
        xs, ys, ps = (t.clone().requires_grad_() for t in (x, y, p))
        xo, yo, po = (t.clone().requires_grad_() for t in (x, y, p))
        got = loss(xs, ys, ps.exp(), idx)
        got.backward()
        want, want_pre = oracle.step(xo, yo, idx, po)
        torch.testing.assert_close(got.detach(), want_pre if version == "v2" else want, rtol=1e-10, atol=0)
        torch.testing.assert_close(xs.grad, xo.grad, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(ys.grad, yo.grad, rtol=1e-9, atol=1e-12)
        if version in ("v1", "v2"):
            assert ps.grad is None
        else:
            torch.testing.assert_close(ps.grad, po.grad, rtol=1e-9, atol=1e-12)
        _compare_tables(loss, oracle, version)


@pytest.mark.parametrize("version", ["v0", "v1", "v2", "v3"])
def test_matches_oracle_over_epochs(version):
    run_scenario(version)


def test_constant_gamma_schedule_and_batch_of_two():
    run_scenario("v3", batch_sizes=(2, 2, 3, 2), gamma_schedule="constant")


def test_fp32_features_and_tables_close_to_oracle():
    loss = make_loss("v0", N, gamma_min=0.5, gamma_decay_epochs=1, eps=1e-14)
    oracle = Oracle("v0", N, eps=1e-14)
    gen = torch.Generator().manual_seed(5)
    for epoch in range(2):
        loss.set_epoch(epoch)
        oracle.set_epoch(epoch, loss.gamma)
        x, y = make_batch(gen, 7, D)
        idx = _ids(gen, 0, 7)
        xs, ys = x.float().requires_grad_(), y.float().requires_grad_()
        ps = torch.tensor(math.log(20.0), requires_grad=True)
        xo, yo = x.clone().requires_grad_(), y.clone().requires_grad_()
        po = torch.tensor(math.log(20.0), dtype=torch.float64, requires_grad=True)
        loss(xs, ys, ps.exp(), idx).backward()
        oracle.step(xo, yo, idx, po)
        torch.testing.assert_close(xs.grad.double(), xo.grad, rtol=2e-4, atol=1e-6)
        torch.testing.assert_close(ps.grad.double(), po.grad, rtol=2e-4, atol=1e-6)
        torch.testing.assert_close(loss.table("u_image").double(), oracle.u_im, rtol=2e-4, atol=0)


def test_rejects_bad_input():
    loss = make_loss("v0", 4, gamma_min=0.5, gamma_decay_epochs=1)
    x = torch.nn.functional.normalize(torch.randn(3, 4), dim=1)
    with pytest.raises(IndexError, match="data_size"):
        loss(x, x, torch.tensor(10.0), torch.tensor([0, 1, 4]))
    with pytest.raises(ValueError, match="repeat"):
        loss(x, x, torch.tensor(10.0), torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match="at least 2"):
        loss(x[:1], x[:1], torch.tensor(10.0), torch.tensor([0]))
    with pytest.raises(ValueError, match="logit_scale"):
        loss(x, x, None, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="version"):
        make_loss("v4", 4, gamma_min=0.5, gamma_decay_epochs=1)


def test_reset_rule_for_tiny_inf_nan_old_values():
    """γ < 1: old u < 1e-35, inf or nan is replaced by g; 1e-30 is kept and averaged."""
    loss = make_loss("v0", 6, gamma_min=0.5, gamma_decay_epochs=1, table_dtype=torch.float64)
    oracle = Oracle("v0", 6)
    old = torch.tensor([1e-40, math.inf, math.nan, 1e-30, 2.0, 0.5], dtype=torch.float64)
    oracle.u_im, oracle.u_tt = old.clone(), old.flip(0).clone()
    state = loss.state_dict()
    state["tables.log_u_image"], state["tables.log_u_text"] = old.log(), old.flip(0).log()
    loss.load_state_dict(state)
    loss.set_epoch(1)
    oracle.set_epoch(1, loss.gamma)
    x, y = make_batch(torch.Generator().manual_seed(3), 6, D)
    xs, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    p = torch.tensor(2.5, dtype=torch.float64)
    loss(xs, y, p.exp(), torch.arange(6)).backward()
    oracle.step(xo, y.clone(), torch.arange(6), p)
    torch.testing.assert_close(loss.table("u_image"), oracle.u_im, rtol=1e-10, atol=0)
    torch.testing.assert_close(loss.table("u_text"), oracle.u_tt, rtol=1e-10, atol=0)
    torch.testing.assert_close(xs.grad, xo.grad, rtol=1e-9, atol=1e-12)


# ----------------------------------------------------------------------------- the oracle itself


def test_oracle_is_rank_count_invariant():
    """Averaging the reference's per-rank losses over K simulated ranks gives the K=1 gradients."""
    gen = torch.Generator().manual_seed(0)
    for version in ("v0", "v3", "v2"):
        results = []
        for k in (1, 2, 3):
            o = Oracle(version, 12, rho=6.5, lr_tau=0.05)
            for epoch, gamma in ((0, 1.0), (1, 0.6)):
                o.set_epoch(epoch, gamma)
                g2 = torch.Generator().manual_seed(epoch)
                x, y = make_batch(g2, 6, 5)
                x.requires_grad_(), y.requires_grad_()
                p = torch.tensor(math.log(1 / 0.1), dtype=torch.float64, requires_grad=True)
                value, _ = o.step(x, y, torch.randperm(12, generator=g2)[:6], p, num_ranks=k)
            results.append((value, x.grad, y.grad, p.grad, o.u_im.clone(), o.tau_tt.clone()))
        for other in results[1:]:
            for want, got in zip(results[0], other, strict=True):
                if want is None:
                    assert got is None
                else:
                    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    del gen


def test_reference_formula_overflows_in_fp32_at_tau_001():
    """The premise of our log-domain estimators: exp((s_ij − s_ii)/τ) is inf in fp32 at τ = 0.01."""
    x = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])
    y = torch.tensor([[-1.0, 0.0], [1.0, 0.0]])  # s_ii = -1, s_ij = +1
    o = Oracle("v1", 2, dtype=torch.float32)
    o.step(x.requires_grad_(), y.requires_grad_(), torch.arange(2), torch.tensor(math.log(100.0)))
    assert torch.isinf(o.u_im).all()
