"""Tower activation memory with and without `--grad-checkpointing`, on the CPU, at one micro-batch size.

For each model, ``toolkit.train.plan.memprobe.measure_activations`` (the measurement behind `toolkit plan`)
fits activations(m) = fixed + per_sample·m from two fresh subprocesses per setting (micro-batches
``--sizes``), each reading the kernel's peak resident set over one training-mode forward + backward of
both towers (uint8 pixels and token ids in, features out). The table gives the activation memory at
``--micro`` (measured at the larger size when it equals ``--micro``) without and with open_clip's
activation checkpointing, and their ratio (the issue's target: >= 2x at micro-batch 64), plus the
constants to paste into ``toolkit/train/plan.py``'s MEASURED_CHECKPOINTED.

    MALLOC_MMAP_THRESHOLD_=131072 python -m benchmarks.trainer.grad_checkpointing   # as plan.MEASURED; ~3 min
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 2**20


def measure(model: str, sizes: tuple[int, int], threads: int) -> dict:
    """Both fits of one model and the memory at the larger size (a measured point, not a prediction)."""
    from toolkit.train.plan.memprobe import measure_activations

    row: dict = {"model": model}
    for label, ckpt in (("plain", False), ("checkpointed", True)):
        start = time.monotonic()
        fit = measure_activations(model, sizes, "fp32", "cpu", threads=threads, grad_checkpointing=ckpt)
        row[label] = {
            "fixed_bytes": fit.fixed_bytes,
            "per_sample_bytes": fit.per_sample_bytes,
            "overhead_bytes": fit.overhead_bytes,
            "points": [list(p) for p in fit.points],
            "seconds": round(time.monotonic() - start, 1),
        }
    return row


def table(rows: list[dict], micro: int) -> str:
    lines = [
        f"| model | activations at micro-batch {micro}, plain | with --grad-checkpointing | saved | "
        "per sample, plain | per sample, checkpointed |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        plain, ckpt = (dict(r[k]["points"])[micro] for k in ("plain", "checkpointed"))
        lines.append(
            f"| {r['model']} | {plain / MiB:.1f} MiB | {ckpt / MiB:.1f} MiB | {plain / ckpt:.2f}x | "
            f"{r['plain']['per_sample_bytes'] / MiB:.2f} MiB | "
            f"{r['checkpointed']['per_sample_bytes'] / MiB:.2f} MiB |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cliptk-tiny,cliptk-small")
    parser.add_argument(
        "--sizes", default="16,64", help="The two micro-batch sizes measured (the larger is the one tabled)."
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "grad_checkpointing.json"))
    args = parser.parse_args()
    sizes = tuple(int(s) for s in args.sizes.split(","))
    rows = [measure(m.strip(), sizes, args.threads) for m in args.models.split(",") if m.strip()]
    text = table(rows, sizes[1])
    print(text)
    for r in rows:
        c = r["checkpointed"]
        print(
            f'    ("{r["model"]}", "fp32", "cpu"): ({c["fixed_bytes"]:_.1f}, {c["per_sample_bytes"]:_.1f}, '
            f"{c['overhead_bytes']:_.1f}),"
        )
    result = {
        "micro_batch": sizes[1],
        "sizes": list(sizes),
        "threads": args.threads,
        "rows": rows,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_1min": os.getloadavg()[0],
            "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        },
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    Path(args.out).with_suffix(".md").write_text(text + "\n")


if __name__ == "__main__":
    main()
