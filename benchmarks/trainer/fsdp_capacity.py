"""The largest model that trains under a fixed per-rank memory, DDP against ``--fsdp`` (issue 42's target:
FSDP at 4 ranks fits >= 2.5x the parameters DDP fits, at the same micro-batch).

A family of models grows by width only: cliptk-small's shape (6 blocks per tower, 64 px images in 8 px
patches, 32-token captions, heads of width 64) with both towers at width W, W on a ladder of multiples of
64. Width, not depth, because that is how a lab outgrows a card (ViT-B -> L): parameters grow as W^2,
activations only as W, so the states that sharding divides dominate. Each point is one real gloo job at
``--world`` ranks through ``fsdp_memory``'s trainer (``TrainModel``, ``fully_shard`` or DDP, AdamW, the
default objective, ``step.forward_backward``; 1 thread per rank), whose per-rank peak resident memory over
steps 2.. (minus the resident set before the parts were built) is compared with ``--budget-gib``.

The search is a bisection per trainer over the ladder: the upper end is the first width whose states alone
(16 bytes per parameter for DDP: weights, gradients, AdamW's two moments; a ``--world``-th of that for FSDP)
exceed the budget, so it never needs measuring; the peak grows with the width, so each measurement halves
what is left (3-4 jobs per trainer). The model is built on the meta device to count its parameters.

    python -m benchmarks.trainer.fsdp_capacity                      # 2 GiB at 4 ranks, ~20 min on 2 cores
    python -m benchmarks.trainer.fsdp_capacity --budget-gib 1 --local-batch 2

Every rank materialises the whole model once before sharding it (``train/fsdp.shard`` wraps a built
model), so the host must hold world x the fp32 weights for a moment; that peak is before step 1 and is not
the budget's. Writes benchmarks/trainer/results/fsdp_capacity.{json,md} (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks.trainer.fsdp_memory import RESULTS, run_world

TARGET_RATIO = 2.5
STATE_BYTES_PER_PARAM = 16  # fp32 weights, gradients, AdamW's exp_avg and exp_avg_sq


def model_config(width: int) -> dict:
    """cliptk-small's shape with both towers at ``width`` (heads of width 64)."""
    return {
        "embed_dim": 512,
        "vision_cfg": {"image_size": 64, "layers": 6, "width": width, "head_width": 64, "patch_size": 8},
        "text_cfg": {
            "context_length": 32,
            "vocab_size": 49408,
            "width": width,
            "heads": width // 64,
            "layers": 6,
        },
    }


def num_params(width: int) -> int:
    """Parameters of ``model_config(width)``, counted on the meta device (nothing allocated)."""
    import torch

    from toolkit.models.factory import build_model

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(model_config(width)).parameters())


def states_exceed(kind: str, params: int, world: int, budget: float) -> bool:
    """Whether the states alone already exceed the budget (so the width cannot fit, unmeasured)."""
    per_rank = params * STATE_BYTES_PER_PARAM / (world if kind == "fsdp" else 1)
    return per_rank > budget


def measure(kind: str, width: int, args, work: Path) -> dict:
    """One gloo job of ``kind`` at ``width``: per-rank peak and state bytes (maxima over the ranks)."""
    path = work / f"width{width}.json"
    path.write_text(json.dumps(model_config(width)))
    job = argparse.Namespace(
        model=str(path), batch=args.local_batch * args.world, micro=0, steps=args.steps, no_reshard=False
    )
    started = time.time()
    got = run_world(job, args.world, work / f"{kind}{width}", kinds=(kind,))[kind]
    return {
        "kind": kind,
        "width": width,
        "params": num_params(width),
        "peak_bytes": got["peak_bytes"],
        "state_bytes": got["state_bytes"],
        "fits": got["peak_bytes"] <= args.budget_gib * 2**30,
        "wall_s": round(time.time() - started, 1),
    }


def largest_fit(kind: str, ladder: list[int], args, work: Path, points: list[dict]) -> dict | None:
    """The measured point of the widest ladder width whose peak fits (module docstring's bisection); every
    measurement is appended to ``points``. None when even the narrowest does not fit."""
    budget = args.budget_gib * 2**30
    hi = next(
        (i for i, w in enumerate(ladder) if states_exceed(kind, num_params(w), args.world, budget)), None
    )
    if hi is None:
        raise SystemExit(
            f"{kind}: the ladder's widest model ({ladder[-1]}) fits by its states; widen --max-width"
        )
    lo, best = -1, None  # ladder[lo] fits (measured), ladder[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        point = measure(kind, ladder[mid], args, work)
        points.append(point)
        print(
            f"{kind} width {point['width']}: {point['params'] / 1e6:.1f} M parameters, peak "
            f"{point['peak_bytes'] / 2**20:.0f} MiB/rank ({'fits' if point['fits'] else 'over'})",
            flush=True,
        )
        if point["fits"]:
            lo, best = mid, point
        else:
            hi = mid
    return best


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget-gib", type=float, default=2.0, help="per-rank memory to fit (GiB)")
    p.add_argument("--world", type=int, default=4, help="ranks")
    p.add_argument("--local-batch", type=int, default=4, help="samples per rank per step (both trainers)")
    p.add_argument("--steps", type=int, default=3, help="steps per job (the peak is of steps 2..)")
    p.add_argument("--min-width", type=int, default=256)
    p.add_argument("--max-width", type=int, default=4096)
    p.add_argument("--width-step", type=int, default=64, help="the ladder's step (a multiple of 64)")
    p.add_argument("--work", type=Path, default=Path("/tmp/cliptk-fsdp-capacity"))
    p.add_argument("--out", type=Path, default=RESULTS / "fsdp_capacity.json")
    args = p.parse_args(argv)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # as fsdp_memory: freed blocks leave the RSS
    args.work.mkdir(parents=True, exist_ok=True)
    ladder = list(range(args.min_width, args.max_width + 1, args.width_step))
    points: list[dict] = []
    started = time.time()
    best = {kind: largest_fit(kind, ladder, args, args.work, points) for kind in ("ddp", "fsdp")}
    ratio = best["fsdp"]["params"] / best["ddp"]["params"] if best["ddp"] and best["fsdp"] else None
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "points": points,
        "largest": best,
        "params_ratio": ratio,
        "target_ratio": TARGET_RATIO,
        "loadavg": os.getloadavg()[0],
        "wall_s": round(time.time() - started, 1),
    }
    table = format_table(result)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(table + "\n")
    return result


def format_table(result: dict) -> str:
    a, mib = result["args"], 2**20
    lines = [
        f"budget {a['budget_gib']} GiB per rank, {a['world']} ranks, {a['local_batch']} samples per rank, "
        f"AdamW fp32, gloo CPU, 1 thread per rank; cliptk-small's shape at width W (both towers); "
        f"load {result['loadavg']:.1f}, {result['wall_s'] / 60:.0f} min",
        "",
        "| trainer | width | parameters (M) | peak MiB/rank | states MiB/rank | fits |",
        "|---|---|---|---|---|---|",
    ]
    for pt in sorted(result["points"], key=lambda q: (q["kind"], q["width"])):
        lines.append(
            f"| {pt['kind']} | {pt['width']} | {pt['params'] / 1e6:.1f} | {pt['peak_bytes'] / mib:.0f} | "
            f"{pt['state_bytes'] / mib:.0f} | {'yes' if pt['fits'] else 'no'} |"
        )
    best, ratio = result["largest"], result["params_ratio"]
    for kind, pt in best.items():
        lines.append("")
        lines.append(
            f"largest {kind}: "
            + (f"width {pt['width']}, {pt['params'] / 1e6:.1f} M parameters" if pt else "none")
        )
    if ratio is not None:
        met = "met" if ratio >= TARGET_RATIO else "missed"
        lines += ["", f"FSDP/DDP parameters that fit: {ratio:.2f}x (target >= {TARGET_RATIO}x: {met})"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
