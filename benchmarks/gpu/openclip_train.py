"""Section 4: open_clip_train on the same model, data (the raw JPEG shards) and batch as the trainer
section, for samples/s side by side: ``python -m open_clip_train.main`` with ``--log-every-n-steps 1``.

open_clip_torch 3.3.0's trainer needs webdataset <= 0.2.86 (benchmarks.shared.trainer_bench says why);
``--open-clip-deps DIR`` puts a folder holding it first on open_clip's PYTHONPATH only (a lent GPU machine
reaches no registry). Without one it is pip-installed into the work folder, as the trainer benchmarks do."""

from __future__ import annotations

import statistics

from benchmarks.gpu import data
from benchmarks.gpu.common import Context, Section, env_with_repo, run_cmd, tail
from benchmarks.gpu.trainer import DRY_DATA, GPU_DATA, steps_for
from benchmarks.shared import trainer_bench as tb

GPU_RUNS = [(512, False), (4096, True)]  # batch, --grad-checkpointing (4,096 without it does not fit 80 GB)
DRY_RUNS = [(16, False)]


def _args(ctx: Context, batch: int, gc: bool, name: str) -> list[str]:
    # resampled shards and as many samples as the trainer section's run of this batch: the same steps
    args = [
        "--train-data",
        tb.shard_pattern(ctx.shared["raw"]),
        "--train-num-samples",
        str(batch * steps_for(batch)),
        "--dataset-resampled",
        "--dataset-type",
        "webdataset",
        "--batch-size",
        str(batch),
        "--precision",
        "fp32" if ctx.dry_run else "amp_bf16",
        "--workers",
        "2" if ctx.dry_run else "8",
        "--epochs",
        "1",
        "--lr",
        "1e-4",
        "--warmup",
        "1",
        "--log-every-n-steps",
        "1",
        "--save-frequency",
        "0",
        "--logs",
        str(ctx.work / "open_clip_logs"),
        "--name",
        name,
        "--report-to",
        "",
        "--seed",
        "0",
        "--device",
        ctx.device,
    ]
    return args + (["--grad-checkpointing"] if gc else [])


def run(ctx: Context, sec: Section) -> None:
    if "raw" not in ctx.shared:
        num_samples, raw_px, model, _ = DRY_DATA if ctx.dry_run else GPU_DATA
        if not data.prepare(ctx, sec, num_samples, raw_px, model):
            return
    deps = ctx.open_clip_deps or tb.open_clip_pythonpath(ctx.work)
    for batch, gc in DRY_RUNS if ctx.dry_run else GPU_RUNS:
        case = f"open_clip_train B={batch} gc={gc}"
        if sec.left_s() < 30:
            sec.skip(case, f"{sec.left_s():.0f} s left of the section's budget")
            continue
        name = f"b{batch}_gc{int(gc)}"
        log = ctx.work / f"open_clip_{name}.log"
        cmd = tb.open_clip_cmd(ctx.shared["model"], _args(ctx, batch, gc, name))
        code, wall = run_cmd(cmd, sec.left_s(), log, env_with_repo(deps))
        steps = tb.open_clip_steps(log.read_text(errors="replace"))
        row = {
            "trainer": "open_clip_train",
            "B": batch,
            "grad_ckpt": gc,
            "model": ctx.shared["model"],
            "steps": len(steps),
            "wall_s": wall,
        }
        if code != 0 or not steps:
            sec.rows.append(row | {"status": f"failed ({code}): {tail(log, 2)}"})
            continue
        times = [r["step_time_s"] for r in steps]
        sec.rows.append(
            row
            | {
                "samples_per_s": tb.steady_samples_per_s(times, batch, skip=1 if len(times) > 1 else 0),
                "median_step_s": statistics.median(times),
                "status": "ok",
            }
        )
