"""Which objective trains CLIP towers best from scratch where the data set is many times the batch: glyphs.

Data (``glyphset``): ``toolkit data glyphs`` (Unicode characters drawn by matplotlib's 16 font styles,
captioned with their Unicode names; by default the 1,067 characters that at least 13 styles draw). Training:
every style but two (~13,900 pairs: ~430x batch 32); ``--val-style`` (DejaVu Serif Bold Italic) is scored
for tuning only; ``--heldout-style`` (STIX General regular: another design, never trained or tuned on) gives
the figures, also without the characters some style draws identically to another (``held_distinct``).

Every run is ``toolkit train`` from random init of ``--model`` (cliptk-glyph: a 32 px ViT and text tower), one
torch thread per process, ``--workers`` processes at a time, with the trainer's own zero-shot retrieval
evaluation (clip-benchmark's metrics) at ``--eval-points`` steps (``runs``). Cells: budgets short
(``--short-epochs``) and long (``--long-epochs``, >= 4x) times global batches (``--batches``), run in the
order given (cell by cell, so an interrupted benchmark has its first cells complete); a long cell runs only
``--long-methods``. In each cell every method (``methods.METHODS``) is tuned on the validation style with
``--tune-seeds`` seeds (a coordinate search: convergence.methods.Search, grids extended past a winning end
``--max-extensions`` times), then its chosen setting runs on ``--seeds`` paired seeds (same init and batch
order per seed). Reported per cell (``report``): held-out R@1 (mean of image→text and text→image), R@10 and
median rank, the same on the set without look-alikes, the paired Δ against the best OpenCLIP (the OpenCLIP
variant with the better validation score) with its std, and R@1 against samples seen and against training time
(PNG).

    python -m benchmarks.objectives.scratch --quick          # CI smoke: 1 cell, 1 seed, tiny set: minutes
    python -m benchmarks.objectives.scratch                  # the default plan: ~1.5 h on 2 quiet cores

Every finished run is kept in ``CACHE/runs.jsonl``; the JSON, the Markdown page and the PNGs are rewritten
after every run (partial results), and ``--cached-only`` reports what is finished without training.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.objectives.convergence import main as convergence_main
from benchmarks.objectives.convergence import methods as cm
from benchmarks.objectives.convergence.methods import GAMMA_DECAY_FRACTION
from benchmarks.objectives.scratch import methods as sm
from benchmarks.objectives.scratch import report as sr
from benchmarks.objectives.scratch.glyphset import GlyphSet, add_set_arguments
from benchmarks.objectives.scratch.runs import WARMUP_FRACTION, Runner, add_run_arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", default="runs/scratch", help="the glyph set, its shards and every finished run")
    add_set_arguments(p)
    p.add_argument("--batches", type=int, nargs="+", default=[128, 32])
    p.add_argument("--regimes", nargs="+", default=["short", "long"], choices=["short", "long"])
    p.add_argument("--short-epochs", type=int, default=6)
    p.add_argument("--long-epochs", type=int, default=24)
    p.add_argument("--seeds", type=int, default=3, help="paired seeds per tuned method")
    p.add_argument("--tune-seeds", type=int, default=1, help="seeds per grid point on validation")
    p.add_argument(
        "--no-tune",
        action="store_true",
        help="no search: every knob at the middle of its grid (reported as untuned)",
    )
    p.add_argument(
        "--untuned",
        nargs="*",
        default=[],
        help="methods run at the trainer's defaults of their "
        "knobs instead of searched (reported as untuned; cheaper)",
    )
    p.add_argument(
        "--max-extensions", type=int, default=1, help="grid steps past a winning end, per knob and end"
    )
    p.add_argument(
        "--methods",
        nargs="*",
        default=None,
        help=f"method names (default: "
        f"{', '.join(sm.DEFAULT_METHODS)}); known: {', '.join(m.name for m in sm.METHODS)}",
    )
    p.add_argument(
        "--long-methods",
        nargs="*",
        default=None,
        help="the long budget's methods (default: --methods when given, else "
        f"{', '.join(sm.DEFAULT_LONG_METHODS)}: a long cell costs 4x a short one, so the default plan runs "
        "no tuning grid there; methods outside "
        "--methods are ignored)",
    )
    add_run_arguments(p)
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 60 characters in >= 12 styles, batch 32, "
        "1 epoch, 1 seed, the learnable-τ OpenCLIP and the drift-corrected v3, untuned "
        "(--no-tune)",
    )
    p.add_argument("--out", default="benchmarks/objectives/results/scratch.json")
    args = p.parse_args(argv)
    if args.quick:
        args.min_fonts, args.limit, args.batches, args.regimes = 12, 60, [32], ["short"]
        args.short_epochs, args.seeds, args.tune_seeds, args.eval_points, args.no_tune = 1, 1, 1, 2, True
        args.methods = args.methods or ["openclip (learnable τ)", "fastclip-v3 (u_drift)"]
    if args.long_methods is None:  # the default plan's long cells; methods named by hand run in every cell
        args.long_methods = list(args.methods or sm.DEFAULT_LONG_METHODS)
    args.methods = args.methods or list(sm.DEFAULT_METHODS)
    if args.tune_seeds > args.seeds:
        p.error("--tune-seeds must not exceed --seeds")
    unknown = set(args.methods + args.untuned + args.long_methods) - {m.name for m in sm.METHODS}
    if unknown:
        p.error(f"unknown method(s) {sorted(unknown)}; known: {[m.name for m in sm.METHODS]}")
    if not any(m.is_openclip for m in sm.METHODS if m.name in args.methods):
        p.error("at least one OpenCLIP method is needed as the reference")
    return args


def make_cells(args: argparse.Namespace, num_train: int) -> list[dict]:
    """(regime, batch) cells in run order: all batches of the first regime, then the next."""
    cells = []
    for regime in args.regimes:
        epochs = args.short_epochs if regime == "short" else args.long_epochs
        for batch in args.batches:
            per_epoch = max(1, num_train // batch)  # the trainer's steps per epoch (no partial batch)
            cells.append(
                {
                    "regime": regime,
                    "batch": batch,
                    "epochs": epochs,
                    "steps_per_epoch": per_epoch,
                    "steps": epochs * per_epoch,
                    "gamma_decay_epochs": max(1, round(epochs * GAMMA_DECAY_FRACTION)),
                }
            )
    return cells


def run_cell(args: argparse.Namespace, runner: Runner, cell: dict, methods: list[cm.Method]) -> dict | None:
    """Tune every method of one cell on validation, run the chosen settings on every seed; the summary, or
    None when its OpenCLIP reference is unfinished (``--cached-only``, failed runs)."""
    searches = {(0, m.name): (cell, m, cm.Search(m, max_extensions=args.max_extensions)) for m in methods}
    for _, m, search in searches.values():
        if args.no_tune:
            search.adopt(dict(search.best), "not tuned (--no-tune: each grid's middle value)")
        elif m.name in args.untuned:
            search.adopt({}, "not tuned (--untuned: the trainer's defaults)")
    unfinished = convergence_main.tune(args, runner, searches)
    final = {
        k: [runner.task(c, m, {**s.inherited, **s.best}, seed) for seed in range(args.seeds)]
        for k, (c, m, s) in searches.items()
        if k not in unfinished
    }
    runner.run_all([t for ts in final.values() for t in ts])
    curves = {k[1]: runner.curves(ts) for k, ts in final.items()}
    done = {n: c for n, c in curves.items() if c is not None}
    openclip = [m.name for m in methods if m.is_openclip and m.name in done]
    if not openclip:
        return None
    summary = sr.summarise(cell, done, {n: searches[(0, n)][2].report() for n in done}, openclip)
    summary["unfinished"] = sorted({m.name for m in methods} - set(done))
    return summary


def write_runs(runner: Runner, path: Path) -> None:
    """The finished runs this benchmark asked for (not the whole cache, which other pages share), final
    numbers only, one row per run (rewritten after each run)."""
    rows = []
    for key, label in runner.used.items():
        c = runner.done.get(key)
        if c is None:
            continue
        rows.append(
            {
                "label": label,
                "val_r1": c["val"][-1],
                "heldout_r1": c["heldout"][-1],
                "heldout_r10": c["heldout_r10"],
                "median_rank": c["median_rank"],
                "distinct_r1": c["heldout_distinct"][-1],
                "wall_s": c["wall_s"],
            }
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.monotonic()
    data = GlyphSet(args)
    methods = [m for m in sm.METHODS if m.name in args.methods]
    out = Path(args.out)
    results: list[dict] = []
    cells = make_cells(args, data.counts["num_train_pairs"])

    def write() -> dict:
        meta = {
            **{k: v for k, v in data.counts.items() if k != "spec"},
            "model": args.model,
            "lr": args.lr,
            "weight_decay": 0.1,
            "warmup_fraction": WARMUP_FRACTION,
            "seeds": args.seeds,
            "tune_seeds": args.tune_seeds,
            "max_extensions": args.max_extensions,
            "eval_points": args.eval_points,
            "min_fonts": args.min_fonts,
            "size": args.size,
            "scripts": args.scripts,
            "limit": args.limit,
            "gamma_decay_fraction": GAMMA_DECAY_FRACTION,
            "workers": args.workers,
            "quick": args.quick,
            "cached_only": args.cached_only,
            "methods": {m.name: {"fields": m.fields, "grid": m.grid, "note": m.note} for m in methods},
            "cells_planned": [f"{c['regime']} b{c['batch']}" for c in cells],
            "cells_done": [f"{c['regime']} b{c['batch']}" for c in results],
            "failed_runs": dict(runner.failed),
            "wall_s": round(time.monotonic() - start, 1),
        }
        report = {"config": meta, "results": results}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
        if results:
            sr.plot(results, out.with_name(f"{out.stem}.png"))
        out.with_suffix(".md").write_text(sr.markdown(report, out.stem))
        write_runs(runner, runs_path)
        return report

    runs_path = out.with_name(f"{out.stem}_runs.json")
    runner = Runner(args, data, on_done=lambda: write_runs(runner, runs_path))
    for cell in cells:
        in_cell = [m for m in methods if cell["regime"] == "short" or m.name in args.long_methods]
        summary = run_cell(args, runner, cell, in_cell)
        if summary is not None:
            results.append(summary)
        write()
    report = write()
    print(out.with_suffix(".md").read_text())
    return report
