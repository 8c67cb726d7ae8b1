"""Single-process behaviour of the distributed helpers: no process group means world size 1.

Every mode (the ring included) must be the plain CLIP loss there, the ledger must stay empty, and the
DDP helpers must pass a plain module through.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import normalize

from toolkit.core import dist as D
from toolkit.kernels.naive import clip_loss
from toolkit.models import unwrap_model
from toolkit.train.ddp import grad_sync, wrap_ddp
from toolkit.train.losses.modes import MODES, contrastive_loss, mean_over_ranks


def _features(b: int, d: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = normalize(torch.randn(b, d, generator=g, dtype=torch.float64), dim=1).to(dtype).requires_grad_()
    y = normalize(torch.randn(b, d, generator=g, dtype=torch.float64), dim=1).to(dtype).requires_grad_()
    a = torch.tensor(1.0 + 20 * torch.rand((), generator=g).item(), requires_grad=True)
    return x, y, a


@pytest.mark.parametrize("backend", ["auto", "naive", "torch"])
@pytest.mark.parametrize("b,d", [(1, 4), (2, 3), (7, 5), (33, 16)])
@pytest.mark.parametrize("mode", MODES)
def test_no_group_equals_clip_loss(mode, b, d, backend):
    assert not D.is_initialized() and D.get_world_size() == 1 and D.get_rank() == 0
    D.LEDGER.reset()
    x, y, a = _features(b, d)
    ref = clip_loss(x.double(), y.double(), a.double())
    want = torch.autograd.grad(ref, (x, y, a))
    loss = contrastive_loss(x, y, a, mode=mode, backend=backend)
    got = torch.autograd.grad(loss, (x, y, a))
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert abs(loss.item() - ref.item()) <= 1e-5 * (a.item() + 1)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        assert ((g.double() - w.double()).norm() / w.double().norm().clamp_min(1e-12)).item() <= 1e-5
    assert D.LEDGER.current()["comm/total/calls"] == 0  # no collective without a group


@pytest.mark.parametrize("mode", MODES)
def test_bf16_features_keep_their_dtype(mode):
    x, y, a = _features(6, 8, torch.bfloat16, seed=1)
    loss = contrastive_loss(x, y, a, mode=mode)
    dx, dy, da = torch.autograd.grad(loss, (x, y, a))
    assert dx.dtype == dy.dtype == torch.bfloat16 and da.dtype == torch.float32
    ref = clip_loss(x.float(), y.float(), a)
    assert abs(loss.item() - ref.item()) <= 1e-4 * (a.item() + 1)  # accumulation is fp32 either way


def test_bad_input_is_refused():
    x, y, a = _features(4, 3)
    with pytest.raises(ValueError, match="unknown distributed loss mode 'allgather'"):
        contrastive_loss(x, y, a, mode="allgather")
    with pytest.raises(ValueError, match="same shape"):
        contrastive_loss(x, y[:3], a, mode="ring")
    with pytest.raises(ValueError, match="logit_scale must be 0-d"):
        contrastive_loss(x, y, a.reshape(1), mode="fastclip")
    with pytest.raises(ValueError, match="unknown kernels backend 'cuda-magic'"):
        contrastive_loss(x, y, a, mode="disco", backend="cuda-magic")


def test_collectives_are_identities_at_world_one():
    t = torch.randn(3, 2, requires_grad=True)
    assert torch.equal(D.all_gather_nograd(t), t) and not D.all_gather_nograd(t).requires_grad
    assert D.all_gather_with_grad(t) is t
    assert D.reduce_scatter_sum(t) is t
    assert mean_over_ranks(torch.tensor(2.5)).item() == 2.5
    D.check_equal_sizes(t)
    D.barrier()


def test_init_from_env_without_launcher(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    info = D.init_from_env(backend="gloo")
    assert (info.rank, info.world_size, info.local_rank, info.backend) == (0, 1, 0, None)
    assert not D.is_initialized()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        D.init_from_env(backend="gloo")


def test_ddp_helpers_pass_a_plain_module_through():
    model = torch.nn.Linear(3, 2)
    assert wrap_ddp(model, grad_dtype="bf16") is model and unwrap_model(model) is model
    with grad_sync(model, enabled=False):
        model(torch.randn(4, 3)).sum().backward()
    assert model.weight.grad is not None
    with pytest.raises(ValueError, match="fp16"):
        wrap_ddp(model, grad_dtype="fp16")


def test_ledger_counts_steps_and_bytes():
    ledger = D.CommLedger()
    ledger.record("all_gather", 100, D.FEATURES, world_size=4)
    ledger.record("reduce_scatter", 400, D.FEATURE_GRADS, world_size=4)
    ledger.record("all_reduce", 1000, D.PARAM_GRADS, world_size=4, calls=2)
    ledger.record("send", 10, D.SCALARS, world_size=4)
    ledger.record("recv", 10, D.SCALARS, world_size=4)
    first = ledger.step()
    assert first["comm/all_gather/features/sent_bytes"] == 300  # (K-1)·n
    assert first["comm/reduce_scatter/feature_grads/sent_bytes"] == 300  # (K-1)/K·n
    assert first["comm/all_reduce/param_grads/calls"] == 2
    assert first["comm/all_reduce/param_grads/bytes"] == 2000
    assert first["comm/all_reduce/param_grads/sent_bytes"] == 3000  # 2(K-1)/K·n per call
    assert first["comm/recv/scalars/sent_bytes"] == 0
    assert first["comm/category/scalars/sent_bytes"] == 10
    assert first["comm/total/calls"] == 6 and first["comm/total/sent_bytes"] == 3610
    assert ledger.current()["comm/total/calls"] == 0
    ledger.record("all_gather", 100, D.FEATURES, world_size=4)
    ledger.step()
    summary = ledger.summary()
    assert summary["steps"] == 2
    assert summary["total"]["comm/all_gather/features/calls"] == 2
    assert summary["per_step"]["comm/total/sent_bytes"] == (3610 + 300) / 2
    ledger.enabled = False
    ledger.record("all_gather", 100, D.FEATURES, world_size=4)
    assert ledger.current()["comm/total/calls"] == 0
