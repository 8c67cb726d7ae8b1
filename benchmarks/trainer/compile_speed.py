"""`toolkit train --compile` on the CPU: compile time and steady-state speed-up over eager, end to end.

Two real training runs of the same config (the Twemoji demo set as training shards, ``--model``,
``--batch-size``, ``--steps``, the OpenCLIP loss unless ``--loss``), one eager and one with ``--compile``,
each in its own process, one step logged per line. Per run: the wall time of the first step (the compiled
run compiles there: inductor's forward and backward graphs) and the median step time of the last half of
the steps (steady state). Compile time = first compiled step − first eager step; speed-up = eager median /
compiled median. A second caption length or micro-batch shape recompiles once more (dynamic shapes), which
the steps after the first also pay: the row's ``compiled_extra_s`` sums every step over the steady median.
Inductor's kernel cache starts empty (``TORCHINDUCTOR_CACHE_DIR`` in the scratch folder): a cold compile.

    python -m benchmarks.trainer.compile_speed                     # cliptk-tiny, batch 64, 16 steps
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "results"


def demo_trainset(base: Path, model: str) -> Path:
    """Real pairs (the Twemoji demo) as training shards for ``model``."""
    from toolkit.core.config import build
    from toolkit.data.acquire import demo, shard
    from toolkit.data.trainset.precompute import stage as precompute

    result = demo.run(build(demo.DemoConfig, {"out": str(base / "demo")}))
    shard.run(
        build(
            shard.ShardConfig,
            {
                "source": result.outputs["train_csv"],
                "out": str(base / "raw"),
                "image_size": 64,
                "samples_per_shard": 500,
            },
        )
    )
    precompute.run(
        build(
            precompute.PrecomputeConfig,
            {
                "input": str(base / "raw"),
                "out": str(base / "train"),
                "model": model,
                "samples_per_shard": 500,
                "num_workers": 1,
            },
        )
    )
    return base / "train"


def train_run(data: Path, out: Path, args: argparse.Namespace, compiled: bool) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "toolkit",
        "--quiet",
        "train",
        "--data",
        str(data),
        "--out",
        str(out),
        "--model",
        args.model,
        "--batch-size",
        str(args.batch_size),
        "--steps",
        str(args.steps),
        "--loss",
        args.loss,
        "--log-every",
        "1",
        "--workers",
        "0",
        "--set",
        "tensorboard=false",
        *(["--compile"] if compiled else []),
    ]
    start = time.monotonic()
    # a fresh inductor cache: the compile time is a cold start's, not a reuse of an earlier run's kernels
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS=str(args.threads),
        TORCHINDUCTOR_CACHE_DIR=str(out.parent / "inductor-cache"),
    )
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    steps = [json.loads(line)["step_time_s"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = statistics.median(steps[len(steps) // 2 :])
    return {
        "wall_s": round(time.monotonic() - start, 1),
        "first_step_s": steps[0],
        "steady_step_s": steady,
        "extra_s": sum(s - steady for s in steps),
        "step_times_s": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="cliptk-tiny")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--loss", default="openclip")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "compile_speed.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = demo_trainset(Path(tmp), args.model)
        eager = train_run(data, Path(tmp) / "eager", args, compiled=False)
        compiled = train_run(data, Path(tmp) / "compiled", args, compiled=True)
    row = {
        "model": args.model,
        "batch_size": args.batch_size,
        "loss": args.loss,
        "steps": args.steps,
        "compile_s": compiled["first_step_s"] - eager["first_step_s"],
        "compiled_extra_s": compiled["extra_s"],
        "speedup": eager["steady_step_s"] / compiled["steady_step_s"],
        "eager": eager,
        "compiled": compiled,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_1min": os.getloadavg()[0],
            "threads": args.threads,
        },
    }
    text = (
        "| model | batch | loss | eager step | compiled step | speed-up | compile time | all compile "
        "overhead |\n"
        "|---|---|---|---|---|---|---|---|\n"
        f"| {args.model} | {args.batch_size} | {args.loss} | {eager['steady_step_s']:.3f} s | "
        f"{compiled['steady_step_s']:.3f} s | {row['speedup']:.2f}x | {row['compile_s']:.1f} s | "
        f"{row['compiled_extra_s']:.1f} s |"
    )
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(row, indent=2) + "\n")
    Path(args.out).with_suffix(".md").write_text(
        text + f"\n\nload (1 min) at the end: {os.getloadavg()[0]:.1f}\n"
    )


if __name__ == "__main__":
    main()
