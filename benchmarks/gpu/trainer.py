"""Section 3: ``toolkit train`` steps on ViT-B-32 in bf16 at global batch 512 and 4,096, with and without
the gradient cache and ``--grad-checkpointing``, with the FastCLIP-v3 and OpenCLIP objectives: steady
samples/s (the steps after the first, which compiles and warms up) and peak device memory, beside
``toolkit plan``'s prediction of the same configuration.

Runs go in priority order and stop at the section's budget; a configuration the plan predicts to exceed
the device's memory by more than 10 % is not run (reported with the prediction)."""

from __future__ import annotations

import json
import subprocess

from benchmarks.gpu import data
from benchmarks.gpu.common import (
    PY,
    Context,
    GiB,
    Section,
    env_with_repo,
    progress,
    run_cmd,
    tail,
    toolkit_cmd,
)
from benchmarks.shared import trainer_bench as tb

# (loss, global batch, micro-batch (0: no gradient cache), grad checkpointing, loss kernels), most telling
# first. The chunked torch kernels in most runs: a fresh process pays Triton's autotuning of every flag
# combination it meets (see the kernels section for the Triton kernels themselves); one run takes the
# default (Triton) to show the CUDA path through the trainer.
GPU_RUNS = [
    ("fastclip-v3", 512, 0, False, "torch"),
    ("openclip", 512, 0, False, "torch"),
    ("fastclip-v3", 4096, 512, False, "torch"),
    ("fastclip-v3", 4096, 512, True, "torch"),
    ("fastclip-v3", 512, 0, False, "auto"),
    ("openclip", 4096, 512, False, "torch"),
    ("fastclip-v3", 4096, 0, True, "torch"),
    ("fastclip-v3", 512, 0, True, "torch"),
    ("fastclip-v3", 4096, 0, False, "torch"),
    ("openclip", 4096, 512, True, "torch"),
]
DRY_RUNS = [("fastclip-v3", 16, 0, False, "auto"), ("openclip", 32, 8, True, "torch")]
GPU_DATA = (4096, 256, "ViT-B-32", "bf16")  # samples, raw image px, model, precision
DRY_DATA = (64, 40, "cliptk-tiny", "fp32")  # fp32: the plan has measured CPU constants for it
MAX_PLANNED = 8  # plan --measure builds the model per configuration (~3 s on CUDA): only the likely-run ones
RUN_START_S = (
    25.0  # a run's start-up before its first step (imports, model build, first batch): H100 estimate
)


def steps_for(batch: int) -> int:
    """Steps of a run: the first warms up (compiles kernels, fills the loader), the rest are timed."""
    return 3 if batch >= 4096 or batch <= 32 else 5


_PLAN_CODE = """
import json, sys
import open_clip
from toolkit.train.plan.config import PlanConfig
from toolkit.train.plan.planner import run
spec = json.loads(sys.argv[1])
tok = open_clip.get_tokenizer(spec["model"])
tokens = int((tok(spec["captions"]) != 0).sum(1).max())
out = []
for c in spec["configs"]:
    kw = dict(model=spec["model"], batch_size=c["B"], loss=c["loss"], micro_batch_size=c["micro"],
              precision=spec["precision"], device=spec["device"], num_samples=spec["num_samples"],
              measure=spec["device"] == "cuda", text_tokens=tokens if spec["device"] == "cuda" else 0)
    if c["gc"] and "grad_checkpointing" in PlanConfig.__dataclass_fields__:
        kw["grad_checkpointing"] = True
    out.append(run(PlanConfig(**kw)).total)
print(json.dumps(out))
"""


def plan_predictions(ctx: Context, runs: list[tuple], model: str, precision: str, timeout_s: float) -> list:
    """``toolkit plan``'s total bytes per device for each run (one subprocess for all); Nones on failure."""
    spec = {
        "model": model,
        "precision": precision,
        "device": ctx.device,
        "num_samples": ctx.shared["num_samples"],
        "captions": [data.caption(i) for i in range(ctx.shared["num_samples"])][-64:],
        "configs": [{"loss": r[0], "B": r[1], "micro": r[2], "gc": r[3]} for r in runs[:MAX_PLANNED]],
    }
    try:
        proc = subprocess.run(
            [PY, "-c", _PLAN_CODE, json.dumps(spec)],
            capture_output=True,
            text=True,
            env=env_with_repo(),
            timeout=timeout_s,
        )
        if proc.returncode == 0:
            found = json.loads(proc.stdout.strip().splitlines()[-1])
            return found + [None] * (len(runs) - len(found))
        ctx.shared["plan_error"] = proc.stderr.strip().splitlines()[-1:]
    except subprocess.TimeoutExpired:
        ctx.shared["plan_error"] = f"toolkit plan ran past {timeout_s:.0f} s"
    return [None] * len(runs)


def has_grad_checkpointing() -> bool:
    proc = subprocess.run(toolkit_cmd("train", "--help"), capture_output=True, text=True, env=env_with_repo())
    return "--grad-checkpointing" in proc.stdout


def train_row(ctx: Context, run: tuple, precision: str, timeout_s: float) -> dict:
    """One ``toolkit train`` run; its steady samples/s and peak memory from RUN/metrics.jsonl."""
    loss, batch, micro, gc, backend = run
    name = f"{loss}_b{batch}_m{micro}_gc{int(gc)}_{backend}"
    out = ctx.work / "runs" / name
    cmd = toolkit_cmd(
        "train",
        "--data",
        str(ctx.shared["train"]),
        "--out",
        str(out),
        "--model",
        ctx.shared["model"],
        "--precision",
        precision,
        "--device",
        ctx.device,
        "--batch-size",
        str(batch),
        "--steps",
        str(steps_for(batch)),
        "--loss",
        loss,
        "--micro-batch-size",
        str(micro),
        "--log-every",
        "1",
        "--workers",
        "2" if ctx.dry_run else "8",
        "--resume",
        "none",
        "--lr",
        "1e-4",
        "--set",
        f"loss.backend={backend}",
    )
    if gc:
        cmd.append("--grad-checkpointing")
    log = ctx.work / f"train_{name}.log"
    code, wall = run_cmd(cmd, timeout_s, log)
    row = {"wall_s": wall}
    if code != 0:
        return row | {"status": "ran past its time" if code is None else f"failed ({code}): {tail(log, 2)}"}
    steps = tb.cliptk_steps(out)
    per_s = tb.steady_samples_per_s([r["step_time_s"] for r in steps], batch, skip=1 if len(steps) > 1 else 0)
    peak = max((r.get("peak_mem_bytes") or 0) for r in steps)
    return row | {
        "samples_per_s": per_s,
        "per_device": per_s,
        "peak_gib": peak / GiB if ctx.device == "cuda" else None,
        "status": "ok",
    }


def run(ctx: Context, sec: Section) -> None:
    num_samples, raw_px, model, precision = DRY_DATA if ctx.dry_run else GPU_DATA
    if not data.prepare(ctx, sec, num_samples, raw_px, model):
        return
    runs = DRY_RUNS if ctx.dry_run else GPU_RUNS
    if not has_grad_checkpointing():
        sec.notes.append("toolkit train has no --grad-checkpointing here: its runs go without it")
        runs = list(dict.fromkeys((loss, b, m, False, k) for loss, b, m, _, k in runs))
    predicted = plan_predictions(ctx, runs, model, precision, min(120.0, sec.left_s() / 3))
    if ctx.shared.get("plan_error"):
        sec.notes.append(f"toolkit plan failed: {ctx.shared['plan_error']}")
    device_bytes = _device_bytes(ctx)
    for r, plan_bytes in zip(runs, predicted, strict=True):
        case = f"{r[0]} B={r[1]} micro={r[2]} gc={r[3]} kernels={r[4]}"
        row = {
            "loss": r[0],
            "B": r[1],
            "micro": r[2],
            "grad_ckpt": r[3],
            "kernels": r[4],
            "precision": precision,
            "plan_gib": None if plan_bytes is None else plan_bytes / GiB,
        }
        if plan_bytes and device_bytes and plan_bytes > 1.1 * device_bytes:
            sec.rows.append(row | {"status": f"not run: plan predicts {plan_bytes / GiB:.1f} GiB > device"})
            continue
        if sec.left_s() < RUN_START_S + 10:
            sec.skip(case, f"{sec.left_s():.0f} s left of the section's budget")
            continue
        sec.rows.append(row | train_row(ctx, r, precision, sec.left_s()))
        progress(sec.name, sec.rows[-1])


def _device_bytes(ctx: Context) -> int | None:
    if ctx.device != "cuda":
        return None
    import torch

    return torch.cuda.get_device_properties(0).total_memory
