"""Tower FLOPs counted from the model config equal torch's FlopCounterMode on real training passes."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from toolkit.models.factory import build_model, resolve_spec
from toolkit.models.flops import step_flops, tower_flops
from toolkit.models.patch_dropout import install, keyed
from toolkit.train.model import TrainModel

# an odd shape beside cliptk-tiny: other widths, MLP ratio, depth, patch and context
ODD = {
    "embed_dim": 24,
    "vision_cfg": {
        "image_size": 24,
        "layers": 3,
        "width": 48,
        "head_width": 16,
        "patch_size": 6,
        "mlp_ratio": 2.5,
    },
    "text_cfg": {"context_length": 11, "vocab_size": 100, "width": 40, "heads": 2, "layers": 2},
}


def _model(cfg: dict, patch_dropout: float) -> TrainModel:
    torch.manual_seed(0)
    clip = build_model(copy.deepcopy(cfg))
    if patch_dropout:
        install(clip, patch_dropout)
    return TrainModel(clip, "image", "tokens", (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)).train()


def _counted(fn) -> int:
    # the math backend of attention: the fused CPU kernel has no FLOP formula registered in torch
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", ["cliptk-tiny", "odd"])
@pytest.mark.parametrize("patch_dropout", [0.0, 0.5, 0.75])
def test_one_training_pass_of_the_towers_is_the_counted_step(name, patch_dropout):
    cfg = ODD if name == "odd" else resolve_spec(name).model_cfg
    model, b = _model(cfg, patch_dropout), 5
    size, length = cfg["vision_cfg"]["image_size"], cfg["text_cfg"]["context_length"]
    image = torch.randint(0, 256, (b, size, size, 3), dtype=torch.uint8)
    text = torch.randint(1, 90, (b, length))

    def step():
        with keyed(model, 7, torch.arange(b)):
            out = model(image, text)
        (out.image_features.sum() + out.text_features.sum()).backward()

    assert _counted(step) == step_flops(tower_flops(cfg, patch_dropout=patch_dropout), b)


def test_the_gradient_cache_adds_one_forward_and_the_loss_is_apart():
    from toolkit.core.config import build
    from toolkit.train.losses import LossConfig, build_loss
    from toolkit.train.step import StepInputs, forward_backward

    cfg, b = resolve_spec("cliptk-tiny").model_cfg, 8
    image = torch.randint(0, 256, (b, 32, 32, 3), dtype=torch.uint8)
    text, index = torch.randint(1, 90, (b, 32)), torch.arange(b)
    counts = {}
    for micro in (0, 3):
        model = _model(cfg, 0.5)
        loss = build_loss(build(LossConfig, {"kind": "openclip", "mode": "gather"}), data_size=b)
        counts[micro] = _counted(
            lambda m=model, lo=loss, mi=micro: forward_backward(
                m,
                lo,
                StepInputs(image, text, index, patch_seed=3),
                micro_batch_size=mi,
                seed_of=lambda i: i,
                autocast=contextlib.nullcontext,
            )
        )
    per_sample = tower_flops(cfg, patch_dropout=0.5)
    extra = step_flops(per_sample, b, gradient_cache=True) - step_flops(per_sample, b)
    assert counts[3] - counts[0] == extra == b * per_sample.total


def test_fewer_tokens_fewer_flops_and_other_towers_are_refused():
    cfg = resolve_spec("cliptk-tiny").model_cfg
    full = tower_flops(cfg)
    assert tower_flops(cfg, image_size=16).image < 0.3 * full.image  # 16 patches instead of 64
    assert tower_flops(cfg, text_tokens=16).text < 0.55 * full.text
    assert tower_flops(cfg, patch_dropout=0.5).text == full.text
    with pytest.raises(ValueError, match="ViT"):
        tower_flops(resolve_spec("RN50").model_cfg)


def test_toolkit_plan_reports_the_counted_step_flops():
    from toolkit.train.plan import planner
    from toolkit.train.plan.config import PlanConfig

    plan = planner.run(PlanConfig(model="cliptk-tiny", device="cpu", batch_size=64, micro_batch_size=16))
    per = tower_flops(resolve_spec("cliptk-tiny").model_cfg)
    assert plan.flops["towers per global step"] == step_flops(per, 64, gradient_cache=True)
    from toolkit.train.plan.report import format_plan

    assert "tower FLOPs (counted)" in format_plan(plan)


def test_toolkit_plan_counts_a_stage_plan():
    from toolkit.train.plan import planner
    from toolkit.train.plan.config import PlanConfig

    cfg = resolve_spec("cliptk-tiny").model_cfg
    plan = planner.run(
        PlanConfig(model="cliptk-tiny", device="cpu", batch_size=64, stages="16px,8tok:0.75;:0.25", steps=100)
    )
    low = step_flops(tower_flops(cfg, image_size=16, text_tokens=8), 64)
    full = step_flops(tower_flops(cfg), 64)
    assert plan.flops["stage 1 (16 px, 8 tok) per step"] == low
    assert plan.flops["stage 2 (full px, full tok) per step"] == full
    share = (75 * low + 25 * full) / (100 * full)
    assert plan.flops[f"run of 100 steps ({share:.2f} x full size)"] == pytest.approx(75 * low + 25 * full)
