"""Largest global batch under a memory budget: `toolkit train` with the gradient cache against open_clip's
trainer with --accum-freq, same model, same micro-batch, one training step per trial.

Each trial is a fresh subprocess taking one optimizer step at global batch B, with forward passes of
``--micro-batch-size`` m samples on both sides:

- cliptk: ``toolkit train --steps 1 --batch-size B --micro-batch-size m --loss openclip --mode gather`` on
  training shards (``toolkit data precompute`` of the Twemoji demo set repeated to ``--cap`` samples);
- open_clip: ``python -m open_clip_train.main --batch-size m --accum-freq B/m --train-num-samples B`` on the
  raw JPEG shards (m must divide B, and B/m is a multiple of ``--workers`` so the epoch is one step).

Memory = the peak resident memory of the trial's whole process tree (trainer + data-loader workers):
the summed PSS (shared pages counted once) polled from /proc every ``--poll-s``, raised to the exact
ru_maxrss of the largest single process when that is higher. Enforcement without cgroups: the poller
SIGKILLs the trial's session as soon as the summed PSS passes the budget ("over budget"); a trial fits
when it finishes its step with its peak <= budget. Search per trainer: B = ``--start``, doubling up to
``--cap``, then bisection between the last fit and the first miss down to ``--resolution`` (relative).
A trial over ``--trial-timeout-s`` is "timeout": the search stops there and the result is a lower
bound. ``--deadline-s`` bounds each trainer's search the same way.

Time, not memory, is what limits this on 2 CPU cores: one step costs ~1.3 forward-backward passes per
sample for cliptk (~5 ms/sample for cliptk-tiny on an idle machine), and open_clip's --accum-freq
additionally evaluates the whole-batch loss (a B x B logit matrix, forward and backward) once per
micro-batch, O(B^3 / m) in all. At the issue's 8 GB budget open_clip's limit (~16-20k by its B^2 logit
memory) takes tens of minutes per trial and cliptk's (hundreds of thousands) hours, so the default run
is scaled down: ``--budget-gb 2``. A smaller budget favours open_clip (its limit shrinks like
sqrt(budget), cliptk's like the budget). The JSON also holds, from the measured points, a fit of peak
memory against B (cliptk linear, open_clip quadratic) and the batch each fit predicts at the budget
and at ``--predict-gb``: predictions, labelled as such.

    python -m benchmarks.trainer.train_memory                        # scaled: 2 GB budget, ~30 min
    python -m benchmarks.trainer.train_memory --budget-gb 8 --cap 1048576 --trial-timeout-s 14400 \
        --deadline-s 86400                                                # the issue's setting: many hours
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from benchmarks.shared import trainer_bench as tb

TARGET = 16  # issue 12: cliptk's largest global batch >= 16x open_clip's
GB = 10**9
TRAINERS = ("open_clip", "cliptk")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="cliptk-tiny")
    p.add_argument("--budget-gb", type=float, default=2.0, help="peak resident memory budget (10^9 bytes)")
    p.add_argument(
        "--predict-gb", type=float, default=8.0, help="budget the fitted curves are also solved for"
    )
    p.add_argument(
        "--micro-batch-size", type=int, default=64, help="m: samples per forward pass, both trainers"
    )
    p.add_argument("--workers", type=int, default=2, help="data-loader processes, both")
    p.add_argument("--start", type=int, default=2048, help="first global batch tried")
    p.add_argument("--cap", type=int, default=32768, help="largest global batch tried (and data set size)")
    p.add_argument("--resolution", type=float, default=0.15, help="bisection stops at hi/lo <= 1 + this")
    p.add_argument("--trial-timeout-s", type=int, default=600, help="wall limit of one trial")
    p.add_argument("--deadline-s", type=int, default=900, help="no new trial of a trainer after this long")
    p.add_argument("--poll-s", type=float, default=0.25, help="memory polling period")
    p.add_argument(
        "--env",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment of both trainers' trials, e.g. MALLOC_MMAP_THRESHOLD_=65536 (glibc "
        "then returns freed activation blocks to the OS: with the cached features preallocated, "
        "cliptk-tiny B=2048 peaked at 1.16 GB instead of 1.31 GB)",
    )
    p.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=TRAINERS)
    p.add_argument("--raw-image-size", type=int, default=64, help="side of the raw JPEGs")
    p.add_argument("--samples-per-shard", type=int, default=2000)
    p.add_argument("--work", type=Path, default=Path("runs/bench/train_memory"), help="scratch folder")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/trainer/results/train_memory"),
        help="writes OUT.json, OUT.md and OUT.png",
    )
    return p.parse_args(argv)


def batch_step(a) -> int:
    """Every B tried is a multiple of this: m, times the workers (one open_clip epoch = one step)."""
    return a.micro_batch_size * max(1, a.workers)


def cliptk_cmd(a, train_dir: Path, b: int, run_dir: Path) -> list[str]:
    return tb.toolkit_cmd(
        "train",
        "--data",
        str(train_dir),
        "--out",
        str(run_dir),
        "--model",
        a.model,
        "--batch-size",
        str(b),
        "--micro-batch-size",
        str(a.micro_batch_size),
        "--steps",
        "1",
        "--loss",
        "openclip",
        "--mode",
        "gather",
        "--workers",
        str(a.workers),
        "--device",
        "cpu",
        "--precision",
        "fp32",
        "--resume",
        "none",
        "--log-every",
        "1",
    )


def open_clip_cmd(a, raw: Path, b: int, run_dir: Path) -> list[str]:
    return tb.open_clip_cmd(
        a.model,
        [
            "--train-data",
            tb.shard_pattern(raw),
            "--dataset-type",
            "webdataset",
            "--train-num-samples",
            str(b),
            "--batch-size",
            str(a.micro_batch_size),
            "--accum-freq",
            str(b // a.micro_batch_size),
            "--epochs",
            "1",
            "--workers",
            str(a.workers),
            "--precision",
            "fp32",
            "--device",
            "cpu",
            "--warmup",
            "1",
            "--log-every-n-steps",
            "1",
            "--save-frequency",
            "0",
            "--logs",
            str(run_dir.parent),
            "--name",
            run_dir.name,
            "--seed",
            "0",
        ],
    )


def stepped(trainer: str, run_dir: Path) -> bool:
    """Did the trial log its optimizer step?"""
    if trainer == "cliptk":
        return (run_dir / "metrics.jsonl").exists() and bool(tb.cliptk_steps(run_dir))
    log = run_dir / "out.log"
    return log.exists() and bool(tb.open_clip_steps(log.read_text()))


def trial(a, ctx: dict, trainer: str, b: int, timeout_s: float) -> dict:
    run_dir = a.work / "trials" / f"{trainer}_{b}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    if trainer == "cliptk":
        cmd, env = cliptk_cmd(a, ctx["train_dir"], b, run_dir), tb.env_with_repo()
    else:
        cmd, env = open_clip_cmd(a, ctx["raw"], b, run_dir), tb.env_with_repo(ctx["pythonpath"])
    env |= dict(kv.split("=", 1) for kv in a.env)
    load = tb.loadavg()
    print(f"[train_memory] {trainer} B={b} ...", file=sys.stderr, flush=True)
    r = tb.run_tree(cmd, env, timeout_s, budget_bytes=int(a.budget_gb * GB), poll_s=a.poll_s)
    status = r.status
    if status == "ok" and not stepped(trainer, run_dir):
        status = "failed: no step logged"
    if status == "ok" and r.peak_bytes > a.budget_gb * GB:
        status = "over budget"  # finished, but its exact peak passed the budget between two polls
    if status == "failed":
        tail = [line for line in r.stderr.splitlines() if line.strip() and not line.startswith("[rusage]")]
        status = "failed: " + (tail[-1][:200] if tail else f"exit {r.returncode}")
    row = {
        "trainer": trainer,
        "B": b,
        "status": status,
        "fits": status == "ok",
        "wall_s": r.wall_s,
        "peak_bytes": r.peak_bytes,
        "peak_tree_pss_bytes": r.peak_pss_bytes,
        "peak_tree_rss_bytes": r.peak_rss_bytes,
        "peak_largest_process_rss_bytes": r.peak_main_rss_bytes,
        "loadavg_before": load,
        "command": " ".join(cmd),
    }
    print(
        f"[train_memory] {json.dumps({k: v for k, v in row.items() if k != 'command'})}",
        file=sys.stderr,
        flush=True,
    )
    shutil.rmtree(run_dir, ignore_errors=True)
    return row


def search(a, ctx: dict, trainer: str) -> dict:
    """Doubling from --start up to --cap, then bisection; bounded by --deadline-s and --trial-timeout-s."""
    unit = batch_step(a)
    snap = lambda b: max(unit, b // unit * unit)  # noqa: E731
    start, rows = time.monotonic(), []
    lo, hi, note = 0, None, ""

    def run(b: int) -> dict | None:
        left = a.deadline_s - (time.monotonic() - start)
        if left <= 0:
            return None
        row = trial(a, ctx, trainer, b, min(a.trial_timeout_s, left))
        rows.append(row)
        return row

    b = snap(a.start)
    while True:
        row = run(b)
        if row is None or row["status"] == "timeout":
            note = f"stopped at B={b}: {'deadline' if row is None else 'trial timeout'}"
            break
        if not row["fits"]:
            hi = b
            break
        lo = b
        if b >= a.cap:
            note = f"fits at the cap B={a.cap}"
            break
        b = min(snap(2 * b), snap(a.cap))
    while hi is not None and not note and hi > lo + unit and hi > lo * (1 + a.resolution):
        b = snap((lo + hi) // 2)
        row = run(b)
        if row is None or row["status"] == "timeout":
            note = f"bisection stopped at B={b}: {'deadline' if row is None else 'trial timeout'}"
            break
        lo, hi = (b, hi) if row["fits"] else (lo, b)
    exact = hi is not None and not note
    return {
        "trainer": trainer,
        "max_fit_B": lo,
        "first_miss_B": hi,
        "exact": exact,
        "note": note or f"largest fit {lo}, smallest miss {hi}",
        "trials": rows,
        "search_s": time.monotonic() - start,
    }


def fit(rows: list[dict], trainer: str, budgets_gb: list[float]) -> dict | None:
    """Least-squares peak(B) over the finished trials (cliptk: a + bB; open_clip: a + bB + cB^2) and the B
    it predicts at each budget: a prediction from measured points, not a measurement."""
    import numpy as np

    pts = [
        (r["B"], r["peak_bytes"])
        for r in rows
        if r["status"] == "ok" or r["status"] == "over budget" and r["peak_largest_process_rss_bytes"]
    ]
    pts = [(b, p) for b, p in pts if p]
    deg = 1 if trainer == "cliptk" else 2
    if len({b for b, _ in pts}) < deg + 1:
        return None
    coef = np.polyfit([b for b, _ in pts], [p for _, p in pts], deg)
    pred = {}
    for g in budgets_gb:
        roots = np.roots(coef - np.array([0] * deg + [g * GB]))
        real = [r.real for r in roots if abs(r.imag) < 1e-6 and r.real > 0]
        pred[f"{g:g}"] = int(min(real)) if real else None
    return {"degree": deg, "coef_high_first": coef.tolist(), "points": len(pts), "predicted_max_B": pred}


def plot(results: list[dict], budget_gb: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for res, color in zip(results, ("tab:red", "tab:blue"), strict=False):
        ok = sorted((r["B"], r["peak_bytes"] / GB) for r in res["trials"] if r["status"] == "ok")
        miss = [(r["B"], r["peak_bytes"] / GB) for r in res["trials"] if r["status"] == "over budget"]
        label = (
            "open_clip_train --accum-freq"
            if res["trainer"] == "open_clip"
            else "toolkit train (gradient cache)"
        )
        if ok:
            ax.plot(*zip(*ok, strict=True), "o-", color=color, label=f"{label}: finished")
        if miss:
            ax.plot(
                *zip(*miss, strict=True),
                "x",
                color=color,
                markersize=9,
                label=f"{label}: over budget (killed, or finished above it)",
            )
    ax.axhline(budget_gb, color="gray", ls="--", label=f"budget {budget_gb:g} GB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global batch B")
    ax.set_ylabel("peak resident memory of the process tree (GB)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(results: list[dict], meta: dict) -> str:
    lines = [
        f"{meta['model']}, micro-batch {meta['micro_batch_size']}, {meta['workers']} loader workers, fp32 "
        "CPU, "
        f"budget {meta['budget_gb']:g} GB peak resident memory (process tree), cap {meta['cap']}; load "
        f"average at start {meta['loadavg_at_start']}",
        "",
        "| trainer | B | status | peak (GB) | tree PSS (GB) | tree RSS (GB) | largest process RSS (GB) "
        "| wall (s) | load avg |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for res in results:
        for r in sorted(res["trials"], key=lambda r: r["B"]):
            lines.append(
                f"| {res['trainer']} | {r['B']} | {r['status']} | {r['peak_bytes'] / GB:.2f} | "
                f"{r['peak_tree_pss_bytes'] / GB:.2f} | {r['peak_tree_rss_bytes'] / GB:.2f} | "
                f"{r['peak_largest_process_rss_bytes'] / GB:.2f} | {r['wall_s']:.0f} | "
                f"{r['loadavg_before']:.1f} |"
            )
    lines.append("")
    for res in results:
        lines.append(f"- {res['trainer']}: largest global batch that fits {res['max_fit_B']} ({res['note']})")
        if res.get("fit"):
            pred = ", ".join(
                f"{g} GB -> {v if v is not None else 'none (the fit does not reach it)'}"
                for g, v in res["fit"]["predicted_max_B"].items()
            )
            lines.append(
                f"  - fitted curve (degree {res['fit']['degree']}, {res['fit']['points']} points) "
                f"predicts: {pred} (prediction, not measured)"
            )
    lines.append(f"- {summary(results)}")
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    by = {r["trainer"]: r for r in results}
    if set(by) != set(TRAINERS) or not by["open_clip"]["max_fit_B"]:
        return "ratio: not available (both trainers needed, and open_clip must fit at least once)"
    ours, theirs = by["cliptk"], by["open_clip"]
    ratio = ours["max_fit_B"] / theirs["max_fit_B"]
    bound = "" if ours["exact"] else ">= "
    verdict = (
        "met" if ratio >= TARGET else ("MISSED" if ours["exact"] else "not shown (lower bound below target)")
    )
    return (
        f"measured ratio cliptk / open_clip: {bound}{ratio:.1f}x (target >= {TARGET}x: {verdict}); "
        f"{ours['max_fit_B']} vs {theirs['max_fit_B']}"
    )


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    unit = batch_step(a)
    a.cap = max(unit, a.cap // unit * unit)
    meta = tb.machine_meta() | {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    # open_clip's pinned webdataset is installed only when its trainer runs
    ctx = {"pythonpath": tb.open_clip_pythonpath(a.work) if "open_clip" in a.trainers else None}
    ctx["raw"], n = tb.raw_shards(a.work, a.raw_image_size, a.samples_per_shard, num_samples=a.cap)
    if "cliptk" in a.trainers:
        ctx["train_dir"] = a.work / f"train_{a.model}_{n}"
        if not (ctx["train_dir"] / "dataset.json").exists():
            tb.check_run(
                tb.toolkit_cmd(
                    "data",
                    "precompute",
                    "--in",
                    str(ctx["raw"]),
                    "--out",
                    str(ctx["train_dir"]),
                    "--model",
                    a.model,
                ),
                "toolkit data precompute",
            )
    meta["num_samples"] = n
    results = []
    for trainer in a.trainers:
        res = search(a, ctx, trainer)
        res["fit"] = fit(res["trials"], trainer, [a.budget_gb, a.predict_gb])
        results.append(res)
        print(f"[train_memory] {trainer}: {res['note']}", file=sys.stderr, flush=True)
    table = markdown(results, meta)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "results": results, "summary": summary(results)}, indent=2)
    )
    a.out.with_suffix(".md").write_text(table + "\n")
    plot(results, a.budget_gb, a.out.with_suffix(".png"))
    print(table)


if __name__ == "__main__":
    main()
