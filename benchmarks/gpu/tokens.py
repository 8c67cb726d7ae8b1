"""Section: the token-budget levers on the device: ViT-B-16 optimiser steps (both towers, the OpenCLIP loss,
AdamW) in bf16 at patch dropout 0, 0.5, 0.75 and at 112 px against 224 px, random pixels and tokens, one
process. Steady samples/s (the first steps warm up: cuDNN/cuBLAS choices, the allocator) and the counted
tower FLOPs per step; the target: dropout 0.5 steps >= 1.6x full tokens. The dry run: cliptk-tiny, fp32, on
the CPU, a small batch."""

from __future__ import annotations

import contextlib

from benchmarks.gpu.common import Context, Section, progress, timed_ms
from benchmarks.trainer.token_budget_speed import SETTINGS, build_setting, time_step

GPU = ("ViT-B-16", 256, 2, 5)  # model, batch, warm-up steps, timed steps: ~0.3 s a step on an H100 (estimate)
DRY = ("cliptk-tiny", 8, 1, 1)


def _samples_per_s(ctx: Context, setting: tuple, batch: int, warm: int, timed: int, autocast) -> float:
    """Steady samples/s of one built setting: the median of ``timed`` steps after ``warm`` untimed ones."""
    model, opt, loss, (image, text, index), _ = setting
    for t in range(warm):
        time_step(model, opt, loss, image, text, index, t, autocast)
    ms = sorted(
        timed_ms(lambda t=t: time_step(model, opt, loss, image, text, index, warm + t, autocast), ctx.device)
        for t in range(timed)
    )
    return batch / (ms[len(ms) // 2] / 1e3)


def run(ctx: Context, sec: Section) -> None:
    import torch

    from toolkit.models.factory import resolve_spec

    model_name, batch, warm, timed = DRY if ctx.dry_run else GPU
    model_cfg = resolve_spec(model_name).model_cfg
    autocast = contextlib.nullcontext if ctx.dry_run else lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    base = None
    for name, (dropout, shrink) in SETTINGS.items():
        if sec.left_s() < 10:
            sec.skip(name, f"{sec.left_s():.0f} s left of the section's budget")
            continue
        setting = build_setting(model_cfg, dropout, shrink, batch, ctx.device)
        per_s = _samples_per_s(ctx, setting, batch, warm, timed, autocast)
        base = base or per_s
        sec.rows.append(
            {
                "setting": name,
                "model": model_name,
                "image_px": setting[3][0].shape[1],
                "batch": batch,
                "precision": "fp32" if ctx.dry_run else "bf16",
                "samples_per_s": per_s,
                "speedup": per_s / base,
                "step_tflop": setting[4]["step"] / 1e12,
                "status": "ok",
            }
        )
        progress(sec.name, sec.rows[-1])
        del setting
        if ctx.device == "cuda":
            torch.cuda.empty_cache()
