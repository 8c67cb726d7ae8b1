"""NeuCLIP against its float64 oracle: values, feature and τ gradients, the network's alternating updates and
restarts, a skipped step, the state's round trip, and the config's checks."""

from __future__ import annotations

import pytest
import torch
from neuclip_oracle import Oracle, p_of, unit_pairs
from safetensors.torch import load_file, save_file

from toolkit.train.losses import LossConfig, build_loss, loss_fields
from toolkit.train.losses.config import NeuCLIPConfig

KW = {"lr": 0.05, "inner_steps": 2, "rho": 6.5, "eps": 1e-6}


def make(num_prototypes=7, restart_every_steps=0, backend="auto", learn_tau=True, fit_order="before", **kw):
    o = {**KW, **kw}
    cfg = LossConfig(
        kind="neuclip",
        rho=o["rho"],
        eps=o["eps"],
        backend=backend,
        learn_tau=learn_tau,
        neuclip=NeuCLIPConfig(
            num_prototypes=num_prototypes,
            lr=o["lr"],
            inner_steps=o["inner_steps"],
            restart_every_steps=restart_every_steps,
            fit_order=fit_order,
        ),
    )
    oracle = Oracle(
        num_prototypes,
        lr=o["lr"],
        inner_steps=o["inner_steps"],
        restart_every_steps=restart_every_steps,
        rho=o["rho"],
        eps=o["eps"],
        learn_tau=learn_tau,
        fit_order=fit_order,
    )
    return build_loss(cfg), oracle


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=lambda m: f"{what}: {m}")


def _run(loss, oracle, batches, taus, learn_tau=True):
    """Both over the same batches; compare every step's value, gradients and the network after its update."""
    for step, ((x, y), tau) in enumerate(zip(batches, taus, strict=True)):
        loss.begin_step(step, 2)
        xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
        p = torch.tensor(p_of(tau), dtype=torch.float64, requires_grad=True)
        value = loss(xs, ys, p.exp(), torch.arange(x.shape[0]))
        value.backward()
        xo, yo = x.clone().requires_grad_(), y.clone().requires_grad_()
        po = torch.tensor(p_of(tau), dtype=torch.float64, requires_grad=True)
        want, err = oracle.step(xo, yo, po, step)
        _close(value.detach(), want, f"step {step} value")
        _close(xs.grad, xo.grad, f"step {step} dx")
        _close(ys.grad, yo.grad, f"step {step} dy")
        if learn_tau:
            _close(p.grad, po.grad, f"step {step} dp")
        else:
            assert p.grad is None
        assert loss.metrics()["normaliser_error"] == pytest.approx(float(err), rel=1e-9)
        loss.end_step(True)
        oracle.end_step()
        _close(loss.network.weight, oracle.w, f"step {step} network")
        _close(loss.network.sumsq, oracle.sumsq, f"step {step} AdaGrad sums")
        assert loss.network.filled == oracle.filled


@pytest.mark.parametrize("big_b,dim,m", [(5, 3, 12), (2, 4, 1), (9, 6, 4)])  # 12 = 5 + 5 + 2 batches' rows
@pytest.mark.parametrize("backend,fit_order", [("auto", "before"), ("naive", "before"), ("auto", "after")])
def test_steps_equal_the_oracle(big_b, dim, m, backend, fit_order):
    gen = torch.Generator().manual_seed(big_b * 100 + dim)
    loss, oracle = make(m, backend=backend, fit_order=fit_order)
    batches = [unit_pairs(big_b, dim, gen) for _ in range(3)]
    _run(loss, oracle, batches, [0.07, 0.05, 0.2])


@pytest.mark.parametrize("fit_order", ["before", "after"])
def test_restarts_and_fixed_tau_equal_the_oracle(fit_order):
    gen = torch.Generator().manual_seed(3)
    loss, oracle = make(6, restart_every_steps=2, learn_tau=False, fit_order=fit_order)
    batches = [unit_pairs(4, 5, gen) for _ in range(5)]
    _run(loss, oracle, batches, [0.1] * 5, learn_tau=False)


def test_low_temperature_stays_finite_in_fp32():
    """τ = 0.01 with anti-aligned positives: exp(a(s_ij − s_ii)) ≈ e^200 overflows fp32 unless computed in
    logs."""
    gen = torch.Generator().manual_seed(5)
    loss, _ = make(8)
    for step in range(3):
        loss.begin_step(step, 2)
        x, y = unit_pairs(10, 6, gen)
        y = -y  # s_ii ≈ −1
        xs, ys = x.float().requires_grad_(), y.float().requires_grad_()
        p = torch.tensor(p_of(0.01), requires_grad=True)
        value = loss(xs, ys, p.exp(), torch.arange(10))
        value.backward()
        assert torch.isfinite(value) and torch.isfinite(xs.grad).all() and torch.isfinite(p.grad)
        loss.end_step(True)
        assert torch.isfinite(loss.network.weight).all()


@pytest.mark.parametrize("fit_order", ["before", "after"])
def test_skipped_step_leaves_the_network_as_it_was(fit_order):
    gen = torch.Generator().manual_seed(11)
    loss, _ = make(5, fit_order=fit_order)
    p = torch.tensor(p_of(0.07), dtype=torch.float64)
    loss.begin_step(0, 2)
    loss(*unit_pairs(4, 3, gen), p.exp(), torch.arange(4))
    loss.end_step(False)  # the first step skipped: not even initialised
    assert not loss.network.initialised
    for step in (0, 1):
        loss.begin_step(step, 2)
        loss(*unit_pairs(4, 3, gen), p.exp(), torch.arange(4))
        loss.end_step(True)
    before = {k: v.clone() for k, v in loss.state_dict().items()}
    loss.begin_step(2, 2)
    loss(*unit_pairs(4, 3, gen), p.exp(), torch.arange(4))
    loss.end_step(False)
    after = loss.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_state_round_trip_through_safetensors_continues_exactly(tmp_path):
    gen = torch.Generator().manual_seed(2)
    batches = [unit_pairs(6, 4, gen) for _ in range(4)]
    p = torch.tensor(p_of(0.05), dtype=torch.float64)
    first, _ = make(5, restart_every_steps=3)
    empty = first.state_dict()
    assert set(empty) == {"network.initialised"}  # nothing learned before the first forward
    for step in range(2):
        first.begin_step(step, 2)
        first(*batches[step], p.exp(), torch.arange(6))
        first.end_step(True)
    save_file({k: v.contiguous() for k, v in first.state_dict().items()}, tmp_path / "loss.safetensors")
    second, _ = make(5, restart_every_steps=3)
    second.load_state_dict(load_file(tmp_path / "loss.safetensors"))
    for step in (2, 3):
        values = []
        for loss in (first, second):
            loss.begin_step(step, 2)
            values.append(loss(*batches[step], p.exp(), torch.arange(6)))
            loss.end_step(True)
        assert torch.equal(values[0], values[1])
    assert torch.equal(first.network.weight, second.network.weight)


def test_load_refuses_another_number_of_prototypes():
    gen = torch.Generator().manual_seed(4)
    loss, _ = make(5)
    loss.begin_step(0, 2)
    loss(*unit_pairs(4, 3, gen), torch.tensor(10.0, dtype=torch.float64), torch.arange(4))
    other, _ = make(6)
    with pytest.raises(
        RuntimeError, match=r"shape \(2, 5, 3\), expected \(2, 6, d\) \(loss.neuclip.num_prototypes\)"
    ):
        other.load_state_dict(loss.state_dict())
    with pytest.raises(RuntimeError, match="network.initialised"):
        other.load_state_dict({})


def test_config_name_mode_and_batch_checks():
    assert loss_fields("neuclip") == {"kind": "neuclip"}
    assert LossConfig(kind="neuclip").name == "neuclip" and LossConfig(kind="neuclip").learns_logit_scale
    with pytest.raises(ValueError, match="neuclip runs in the fastclip mode only"):
        LossConfig(kind="neuclip", mode="gather")
    loss, _ = make(3)
    x, y = unit_pairs(1, 3, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="at least 2 pairs"):
        loss(x, y, torch.tensor(10.0, dtype=torch.float64), torch.arange(1))
