"""Section 7: `--fsdp` on one GPU: a ViT-B-16 training step (AdamW, FastCLIP-v3) with the trainer's FSDP2
wrapping (``train/fsdp.shard``: bf16 parameters and all-gathers, fp32 reductions and master shards), with and
without ``--fsdp-cpu-offload``, beside the same step unwrapped (what DDP runs on each rank): step time, peak
device memory and the parameter + gradient + optimiser bytes held on the device.

One GPU shows the wrapping's cost and the bf16 policy, not the sharding (a mesh of one rank holds every
shard); the per-rank saving at K ranks is benchmarks/trainer/fsdp_memory.py's (CPU, gloo). The dry run takes
the same path on the CPU with cliptk-tiny in fp32 (gloo, a group of one).
"""

from __future__ import annotations

import statistics
import time

from benchmarks.gpu.common import Context, Section

CASES = (
    ("unwrapped (DDP's per-rank model)", False, False),
    ("fsdp", True, False),
    ("fsdp + cpu offload", True, True),
)


def _step_case(
    model_name: str, batch: int, steps: int, device, precision: str, fsdp: bool, offload: bool
) -> dict:
    import torch

    from benchmarks.trainer.fsdp_memory import _state_bytes
    from toolkit.core.config import build
    from toolkit.core.seeds import stream_seed
    from toolkit.train import fsdp as fsdp_lib
    from toolkit.train.losses import LossConfig, build_loss
    from toolkit.train.optim import OptimConfig
    from toolkit.train.plan.memprobe import build_tower_model, tower_inputs
    from toolkit.train.runtime import autocast
    from toolkit.train.step import StepInputs, forward_backward
    from toolkit.train.update import Update

    cuda = device.type == "cuda"
    if cuda:
        torch.zeros(1, device=device)  # a CUDA context first: resetting the stats before one is an error
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build_tower_model(model_name).to(device).train()
    sharded = fsdp_lib.shard(model, precision, offload, device) if fsdp else None
    loss_cfg = build(LossConfig, {"kind": "fastclip", "fastclip": {"version": "v3"}, "mode": "fastclip"})
    loss_fn = build_loss(loss_cfg, data_size=batch, check_sizes=False)
    update = Update(model.clip, loss_fn, build(OptimConfig, {"lr": 1e-4}), loss_cfg, steps, precision)
    if sharded is not None:
        update.clip_grad_norm = sharded.clip_grad_norm
    image, text = tower_inputs(model, batch, device)
    index = torch.arange(batch, device=device)
    cast = autocast(precision, device.type)  # as the trainer: autocast beside FSDP's bf16 parameters
    times, state = [], 0
    try:
        for t in range(steps):
            start = time.perf_counter()
            update.begin(t, steps)
            forward_backward(
                model,
                loss_fn,
                StepInputs(image, text, index),
                micro_batch_size=0,
                seed_of=lambda i, t=t: stream_seed(0, t, 0, i),
                autocast=cast,
            )
            if sharded is not None:
                sharded.finish_backward()
            if t == 1:  # gradients and optimiser state both exist
                state = _state_bytes(model.clip, update.optimizer) if not cuda else 0
            update.finish(loss_fn.global_value())
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        on_device = sum(
            p.to_local().numel() * p.to_local().element_size()
            if hasattr(p, "to_local")
            else p.numel() * p.element_size()
            for p in model.clip.parameters()
            if (p.to_local() if hasattr(p, "to_local") else p).device.type == device.type
        )
    finally:
        if sharded is not None:
            sharded.close()
    peak = torch.cuda.max_memory_allocated(device) if cuda else 0
    return {
        "step_ms": statistics.median(times[1:]) * 1e3,
        "peak_gib": peak / 2**30,
        "params_on_device_mib": on_device / 2**20,
        "state_mib_cpu": state / 2**20,
    }


def run(ctx: Context, sec: Section) -> None:
    import torch

    cuda = ctx.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model, batch, steps, precision = ("ViT-B-16", 128, 6, "bf16") if cuda else ("cliptk-tiny", 8, 3, "fp32")
    for name, fsdp, offload in CASES:
        if sec.left_s() < 5:
            sec.skip(name, "out of the section's time budget")
            continue
        if offload and not cuda:
            sec.skip(name, "CPU offload is a device-memory saving: CUDA only")
            continue
        try:
            row = _step_case(model, batch, steps, device, precision, fsdp, offload)
            sec.rows.append(
                {"case": name, "model": model, "batch": batch, "precision": precision, "status": "ok", **row}
            )
        except torch.cuda.OutOfMemoryError as err:
            sec.rows.append({"case": name, "model": model, "status": f"out of memory: {err}"[:200]})
    base = next((r for r in sec.rows if r["case"] == CASES[0][0] and r["status"] == "ok"), None)
    for r in sec.rows:
        if base and r["status"] == "ok" and cuda:
            r["peak_vs_unwrapped"] = r["peak_gib"] / base["peak_gib"]
            r["time_vs_unwrapped"] = r["step_ms"] / base["step_ms"]
