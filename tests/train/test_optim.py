"""Optimisers: parameter groups on an open_clip model, each optimiser steps, LAMB equals the reference's."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from toolkit.train.optim import OptimConfig, build_optimizer, logit_scale_group, param_groups


class _Tiny(nn.Module):
    """Names like open_clip's: ln_* gains, biases, a bn, a 2-d projection and the logit scale."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.ln_final = nn.LayerNorm(3)
        self.bn1 = nn.BatchNorm1d(4)
        self.text_projection = nn.Parameter(torch.randn(3, 3))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
        self.frozen = nn.Parameter(torch.randn(2, 2), requires_grad=False)


def _ids(group):
    return {id(p) for p in group["params"]}


def test_groups_split_decay_gains_and_logit_scale():
    m = _Tiny()
    groups = param_groups(m.named_parameters(), weight_decay=0.1, lr_tau=2e-4)
    assert [g["name"] for g in groups] == ["no_decay", "decay", "logit_scale"]
    assert _ids(groups[0]) == {
        id(m.proj.bias),
        id(m.ln_final.weight),
        id(m.ln_final.bias),
        id(m.bn1.weight),
        id(m.bn1.bias),
    }
    assert _ids(groups[1]) == {id(m.proj.weight), id(m.text_projection)}
    assert _ids(groups[2]) == {id(m.logit_scale)} and groups[2]["lr"] == 2e-4
    assert [g["weight_decay"] for g in groups] == [0.0, 0.1, 0.0]
    m.logit_scale.requires_grad_(False)  # v1 / v2: constant logit scale, no group
    assert [g["name"] for g in param_groups(m.named_parameters(), 0.1)] == ["no_decay", "decay"]


def test_groups_on_open_clip_model():
    import open_clip

    model = _open_clip_tiny(open_clip)
    groups = param_groups(model.named_parameters(), 0.2)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim < 2 or "ln" in names[id(p)] or "bias" in names[id(p)] for p in groups[0]["params"])
    assert all(p.ndim >= 2 for p in groups[1]["params"])
    assert [names[id(p)] for p in groups[2]["params"]] == ["logit_scale"]
    total = sum(len(g["params"]) for g in groups)
    assert total == sum(1 for p in model.parameters() if p.requires_grad)


def _open_clip_tiny(open_clip):
    cfg = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 16, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8},
        "text_cfg": {"context_length": 8, "vocab_size": 100, "width": 32, "heads": 2, "layers": 1},
    }
    return open_clip.model.CLIP(**cfg)


@pytest.mark.parametrize("name", ["adamw", "lamb", "lion", "sgd"])
def test_each_optimizer_builds_and_steps(name):
    torch.manual_seed(0)
    m = _Tiny()
    opt = build_optimizer(m, OptimConfig(name=name, lr=1e-2, weight_decay=0.1), lr_tau=1e-3)
    assert logit_scale_group(opt)["lr"] == 1e-3
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    m.bn1.train()
    out = m.ln_final(m.proj(m.bn1(torch.randn(5, 4)))) @ m.text_projection
    (out.pow(2).mean() * m.logit_scale.exp()).backward()
    opt.step()
    for n, p in m.named_parameters():
        if n == "frozen":
            assert torch.equal(p, before[n])
        elif p.grad is not None:
            assert not torch.equal(p, before[n]), (name, n)


def test_lamb_matches_reference_lamb_step():
    """timm's Lamb as configured = the reference's LAMB: Adam direction (bias-corrected) + decay, trust
    ratio ‖w‖/‖step‖ only where weight decay is non-zero, no gradient clipping."""
    torch.manual_seed(1)
    w = nn.Parameter(torch.randn(4, 3) * 3)
    b = nn.Parameter(torch.randn(3))
    holder = nn.Module()
    holder.weight, holder.bias = w, b
    opt = build_optimizer(
        holder, OptimConfig(name="lamb", lr=0.1, weight_decay=0.1, beta1=0.9, beta2=0.98, eps=1e-6)
    )
    state = {id(p): (torch.zeros_like(p), torch.zeros_like(p), p.detach().clone()) for p in (w, b)}
    for step in range(1, 4):
        grads = {id(w): torch.randn(4, 3) * 10, id(b): torch.randn(3) * 10}
        w.grad, b.grad = grads[id(w)].clone(), grads[id(b)].clone()
        opt.step()
        for p, wd in ((w, 0.1), (b, 0.0)):
            m, v, ref = state[id(p)]
            g = grads[id(p)]
            m.mul_(0.9).add_(g, alpha=0.1)
            v.mul_(0.98).addcmul_(g, g, value=0.02)
            upd = (m / (1 - 0.9**step)) / ((v / (1 - 0.98**step)).sqrt() + 1e-6)
            trust = 1.0
            if wd:
                upd = upd + wd * ref
                trust = (ref.norm() / upd.norm()).item()
            ref.add_(upd, alpha=-0.1 * trust)
            torch.testing.assert_close(p.detach(), ref, rtol=1e-5, atol=1e-6)


def test_rejects_model_without_trainable_parameters():
    m = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable"):
        build_optimizer(m, OptimConfig())


def test_adamw_is_fused_and_equals_the_per_parameter_update():
    """The fused kernel (chosen on the CPU for speed) takes the same steps as torch's reference loop."""
    torch.manual_seed(0)
    fused_model, loop_model = _Tiny(), _Tiny()
    loop_model.load_state_dict(fused_model.state_dict())
    cfg = OptimConfig(name="adamw", lr=1e-2, weight_decay=0.1)
    fused = build_optimizer(fused_model, cfg, lr_tau=1e-3)
    assert all(g["fused"] for g in fused.param_groups)
    loop = torch.optim.AdamW(
        param_groups(loop_model.named_parameters(), 0.1, 1e-3),
        lr=1e-2,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        foreach=False,
    )
    for step in range(5):
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        for m, opt in ((fused_model, fused), (loop_model, loop)):
            opt.zero_grad()
            (m.ln_final(m.proj(m.bn1(x))) @ m.text_projection).pow(2).mean().mul(
                m.logit_scale.exp()
            ).backward()
            opt.step()
    for (name, a), (_, b) in zip(fused_model.named_parameters(), loop_model.named_parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
