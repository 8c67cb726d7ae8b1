"""Which objective trains best at a small global batch: tuned, paired-seed evidence on held-out drawings.

Data (``emoji_artists``): the ~1,900 emoji concepts captioned with their Unicode names, drawn by four
artists from the package registries. The heads train on three artists (Twemoji, Noto, Fluent: ~5,100
pairs) and are scored on the fourth (OpenMoji), never trained on: retrieval R@1 between its drawings
and the captions (clip-benchmark's definition; image→text and text→image, and their mean). Tuning
never sees OpenMoji: a validation split holds back, from each training artist, the drawings of a
disjoint share of the concepts (``--val-fraction``; the other artists' drawings of them stay in
training, so validation asks what the test asks — a new drawing of a known concept).

Main regime, LiT: frozen EfficientNet-Lite0 and MiniLM towers (features computed once and cached), two
linear heads and τ trained — seconds per run — by the trainer's own step: ``toolkit.train.model`` (heads
initialised as ``toolkit train --seed`` does), ``build_loss``, ``Update``, ``TrainData``'s steps per epoch
and ``loop.train_step`` (schedules, ``step.forward_backward``, the update or a skip) over the global batch
order ``BatchOrder``. Every method of a cell runs
the same batches from the same initial heads per seed, so differences are paired.

Cells: two regimes — short (``--short-epochs``, default 6) and long (``--long-epochs``, default 30) —
times global batches 32, 64, 256. In each cell every method (``methods.METHODS``: a name,
its LossConfig fields and its tuning grid; FastCLIP's final γ is one of the knobs, and DRRho-CLIP's γ
rule and SCENT's estimator update are methods of their own) is tuned on validation with ``--tune-seeds`` seeds
(a coordinate search whose grids are extended past any end that wins), then its chosen setting runs on
``--seeds`` paired seeds (the tuning seeds' runs are reused). Reported per cell
(``report``): held-out R@1 mean ± std, paired Δ against the best OpenCLIP (the OpenCLIP
variant with the better validation score), whether Δ > 2 std, and the steps needed to reach the best
OpenCLIP's final score. Each finished run is kept in ``CACHE/runs.jsonl`` (keyed by everything that
defines it), so an interrupted benchmark resumes and a new method costs only its own runs; ``--fresh``
ignores the cache (do that after changing an objective's code).

    python -m benchmarks.objectives.convergence                # full: ~1 h with 2 workers here
    python -m benchmarks.objectives.convergence --quick        # smoke run: 1 cell, 2 seeds

One from-scratch cell (``--scratch-seeds``, default 3; 0 leaves it out): cliptk-tiny (32 px ViT and text
tower from random init) at batch 64 for ``--scratch-epochs``, comparing the best OpenCLIP and the best
cliptk objective of the LiT short-regime batch-64 cell with the knobs tuned there.

Writes ``--out`` (JSON), the same path with ``.md`` (tables, targets), and ``<stem>_<regime>.png``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.objectives.convergence import methods as cm
from benchmarks.objectives.convergence import report as cr
from benchmarks.objectives.convergence.methods import GAMMA_DECAY_FRACTION
from benchmarks.objectives.convergence.runs import WARMUP_FRACTION, Data, Runner


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", default="runs/convergence", help="features, npm packages and finished runs")
    p.add_argument("--train-artists", nargs="+", default=["twemoji", "noto", "fluent"])
    p.add_argument("--heldout-artist", default="openmoji")
    p.add_argument(
        "--heads", default="cliptk-small", help="model config whose embed_dim the heads project to"
    )
    p.add_argument("--batches", type=int, nargs="+", default=[32, 64, 256])
    p.add_argument("--short-epochs", type=int, default=6)
    p.add_argument("--long-epochs", type=int, default=30)
    p.add_argument("--regimes", nargs="+", default=["short", "long"], choices=["short", "long"])
    p.add_argument("--seeds", type=int, default=5, help="paired seeds per tuned method")
    p.add_argument("--tune-seeds", type=int, default=1, help="seeds per grid point on validation")
    p.add_argument("--methods", nargs="*", default=None, help="method names (default: every available one)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--val-fraction", type=float, default=0.15)
    p.add_argument(
        "--num-concepts",
        type=int,
        default=None,
        help="use this many concepts, evenly spaced over "
        "the Unicode order (default: all ~1,900; fewer makes every run proportionally cheaper)",
    )
    p.add_argument("--eval-points", type=int, default=20, help="evaluations per run (the curves' resolution)")
    p.add_argument("--workers", type=int, default=2, help="processes (one torch thread each)")
    p.add_argument("--fresh", action="store_true", help="ignore finished runs in CACHE/runs.jsonl")
    p.add_argument(
        "--cached-only",
        action="store_true",
        help="train nothing: report the finished runs of "
        "CACHE/runs.jsonl, leaving out (and listing) every method whose tuning or seeds are unfinished",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: batch 32, short regime of 2 epochs, 2 seeds, 4 evaluations",
    )
    p.add_argument(
        "--scratch-seeds",
        type=int,
        default=3,
        help="seeds of the from-scratch cliptk-tiny cell (0: leave it out)",
    )
    p.add_argument("--scratch-epochs", type=int, default=4)
    p.add_argument(
        "--knobs-from",
        nargs="+",
        default=None,
        help="result JSONs whose cells' tuned knobs are reused (the first file with a cell of the same "
        "batch and regime holding the method, else of the same batch, said on stdout) instead of tuning "
        "here: cheaper, and reported as such",
    )
    p.add_argument(
        "--long-knobs-from", nargs="+", default=None, help="as --knobs-from, for the long regime only"
    )
    p.add_argument("--long-methods", nargs="+", default=None, help="the long regime's methods (default: all)")
    p.add_argument(
        "--long-batches",
        type=int,
        nargs="+",
        default=None,
        help="the long regime's batches (default: --batches)",
    )
    p.add_argument("--out", default="benchmarks/objectives/results/convergence.json")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.regimes, args.short_epochs = [32], ["short"], 2
        args.seeds, args.tune_seeds, args.eval_points, args.scratch_seeds = 2, 1, 4, 0
    if args.tune_seeds > args.seeds:
        p.error("--tune-seeds must not exceed --seeds")
    return args


def make_cells(args: argparse.Namespace, num_train: int) -> list[dict]:
    """Every (regime, batch) cell: epochs, steps (the trainer's steps_per_epoch times epochs), γ's decay
    (over GAMMA_DECAY_FRACTION of the epochs: the CC3M preset's 18 of 37, as the trainer's default
    objective)."""
    cells = []
    for regime in args.regimes:
        epochs = args.short_epochs if regime == "short" else args.long_epochs
        for batch in (args.long_batches or args.batches) if regime == "long" else args.batches:
            per_epoch = max(1, num_train // batch)  # the trainer's steps_per_epoch
            cells.append(
                {
                    "regime": regime,
                    "batch": batch,
                    "epochs": epochs,
                    "steps_per_epoch": per_epoch,
                    "methods": args.long_methods if regime == "long" else None,
                    "steps": epochs * per_epoch,
                    "gamma_decay_epochs": max(1, round(epochs * GAMMA_DECAY_FRACTION)),
                }
            )
    return cells


def select_methods(names: list[str] | None) -> tuple[list[cm.Method], dict[str, str]]:
    """The methods to run and {skipped method: why}."""
    unknown = set(names or ()) - {m.name for m in cm.METHODS}
    if unknown:
        raise SystemExit(f"unknown method(s) {sorted(unknown)}; known: {[m.name for m in cm.METHODS]}")
    chosen, skipped = [], {}
    for m in cm.METHODS:
        if names is not None and m.name not in names:
            continue
        why = cm.unavailable(m)
        if why:
            skipped[m.name] = why
        else:
            chosen.append(m)
    return chosen, skipped


def tune_and_run(
    args: argparse.Namespace, runner: Runner, cells: list[dict], methods: list[cm.Method]
) -> tuple[list[dict], list[str]]:
    """Tune every method in every cell on validation, run the chosen settings on all seeds, summarise.
    Returns the cells' summaries and the (cell, method)s left unfinished (``--cached-only``)."""
    in_cell = {
        i: [m for m in methods if m.name in (cells[i].get("methods") or [m.name])] for i in range(len(cells))
    }
    searches = {(i, m.name): (cells[i], m, cm.Search(m)) for i in range(len(cells)) for m in in_cell[i]}
    if args.knobs_from:
        adopt_knobs(args.knobs_from, searches, {"short", "long"})
    if args.long_knobs_from:
        adopt_knobs(args.long_knobs_from, searches, {"long"})
    unfinished = tune(args, runner, searches)
    final = {
        k: [runner.task(cell, m, {**s.inherited, **s.best}, seed) for seed in range(args.seeds)]
        for k, (cell, m, s) in searches.items()
        if k not in unfinished
    }
    runner.run_all([t for ts in final.values() for t in ts])
    unfinished |= {k for k, ts in final.items() if any(t["key"] not in runner.done for t in ts)}
    out = []
    for i, cell in enumerate(cells):
        names = [m.name for m in in_cell[i] if (i, m.name) not in unfinished]
        openclip = [m.name for m in in_cell[i] if m.is_openclip and m.name in names]
        if openclip:
            plain = tuple(m.name for m in in_cell[i] if m.kind == "openclip" and not m.is_openclip)
            out.append(
                cr.summarise(
                    cell,
                    {n: runner.curves(final[(i, n)]) for n in names},
                    {n: searches[(i, n)][2].report() for n in names},
                    openclip,
                    plain,
                )
            )
    return out, sorted(f"{cells[i]['regime']} batch {cells[i]['batch']}: {name}" for i, name in unfinished)


def tune(args: argparse.Namespace, runner: Runner, searches: dict) -> set:
    """The coordinate searches, round by round (every search's pending points run together); a method that
    inherits knobs starts once its source's search is done, and a finished search's remaining seeds run in
    the rounds of the others (the workers stay busy, and an interrupted benchmark has its first methods'
    rows complete: ``--cached-only``). Returns the searches left unfinished."""
    tune_seeds, unfinished = range(args.tune_seeds), set()
    waiting = {k for k, (_, m, s) in searches.items() if m.inherits and not s.adopted_from}
    while True:
        for k in sorted(waiting):
            parent_key = (k[0], searches[k][1].inherits[0])
            parent = searches.get(parent_key)
            if parent is None or not parent[2].pending() or parent_key in unfinished:
                source = parent[2].best_fields() if parent is not None else {}
                searches[k][2].inherit({n: source[n] for n in searches[k][1].inherits[1] if n in source})
                waiting.discard(k)
                if parent_key in unfinished:
                    unfinished.add(k)
        live = [k for k in searches if k not in waiting and k not in unfinished]
        points = [
            (
                k,
                knobs,
                [
                    runner.task(searches[k][0], searches[k][1], {**searches[k][2].inherited, **knobs}, seed)
                    for seed in tune_seeds
                ],
            )
            for k in live
            for knobs in searches[k][2].pending()
        ]
        if not points and not waiting:
            return unfinished
        seeds = [
            runner.task(cell, m, {**s.inherited, **s.best}, seed)
            for k in live
            for cell, m, s in [searches[k]]
            if not s.pending()
            for seed in range(args.seeds)
        ]
        runner.run_all([t for _, _, ts in points for t in ts] + seeds)
        for k, knobs, ts in points:
            if any(t["key"] not in runner.done for t in ts):
                unfinished.add(k)
            else:
                searches[k][2].record(knobs, cr.val_score(runner.curves(ts)))
        for k in live:
            if k not in unfinished:
                searches[k][2].advance()


def adopt_knobs(paths: list[str], searches: dict, regimes: set[str]) -> None:
    """Skip tuning in ``regimes``: take each method's chosen knobs from the cell of the same batch in an
    earlier result (``--knobs-from``, ``--long-knobs-from``: cheaper when compute is short; reported); of
    several files the first with such a cell of the same regime wins, else the first of another regime (said
    on stdout). A method without a grid has nothing to adopt; one that no
    file has is tuned here."""
    earlier = [(path, c) for path in paths for c in json.loads(Path(path).read_text())["results"]]
    for cell, method, search in searches.values():
        if cell["regime"] not in regimes or not method.grid:
            continue
        holding = [(p, c) for p, c in earlier if c["batch"] == cell["batch"] and method.name in c["rows"]]
        # a cell of the same regime first, in any file: a long cell given a short cell's knobs trains with
        # the short budget's lr_tau (1e-4 where the long cells chose 1e-5 at batch 32)
        found = next(((p, c) for p, c in holding if c["regime"] == cell["regime"]), None)
        if found is None and holding:
            found = holding[0]
            print(
                f"--knobs-from: no {cell['regime']} batch-{cell['batch']} cell with {method.name}; "
                f"taking the {found[1]['regime']} cell's knobs from {found[0]}"
            )
        if found is None:  # a method newer than the files: tuned here, as without --knobs-from
            print(f"--knobs-from: no batch-{cell['batch']} cell with {method.name}; tuning it here")
            continue
        path, source = found
        search.adopt(source["rows"][method.name]["tuning"]["chosen"], f"{source['regime']} regime ({path})")


def scratch_cell(
    args: argparse.Namespace, runner: Runner, lit: list[dict], methods: list[cm.Method], num_train: int
) -> dict | None:
    """The from-scratch cliptk-tiny cell at batch 64 (``--scratch-epochs``, ``--scratch-seeds``): the best
    OpenCLIP and the best cliptk objective of the LiT short-regime batch-64 cell, with the knobs tuned
    there (too slow to tune from scratch here: a cliptk-tiny step costs ~30 LiT steps)."""
    source = next((c for c in lit if c["regime"] == "short" and c["batch"] == 64), None)
    if source is None:
        print("scratch cell skipped: it takes its methods and knobs from the short regime's batch-64 cell")
        return None
    names = [n for n in (source["best_openclip"], source["best_cliptk"]) if n is not None]
    cell = {
        **make_cells(
            argparse.Namespace(
                **{**vars(args), "regimes": ["short"], "batches": [64], "short_epochs": args.scratch_epochs}
            ),
            num_train,
        )[0],
        "regime": "scratch",
        "mode": "scratch",
        "model": "cliptk-tiny",
        "knobs_from": "LiT short, batch 64",
    }
    by_name = {m.name: m for m in methods}
    tasks = {
        n: [
            runner.task(cell, by_name[n], source["rows"][n]["tuning"]["chosen"], seed)
            for seed in range(args.scratch_seeds)
        ]
        for n in names
    }
    runner.run_all([t for ts in tasks.values() for t in ts])
    reports = {n: source["rows"][n]["tuning"] for n in names}
    openclip = [n for n in names if by_name[n].is_openclip]
    return cr.summarise(cell, {n: runner.curves(ts) for n, ts in tasks.items()}, reports, openclip)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.monotonic()
    data = Data(args, scratch=args.scratch_seeds > 0)  # computes and caches the features before any worker
    methods, skipped = select_methods(args.methods)
    for name, why in skipped.items():
        print(f"skipping {name}: {why}", flush=True)
    if not any(m.is_openclip for m in methods):
        raise SystemExit("at least one OpenCLIP method is needed as the reference")
    runner = Runner(args, data, scratch=args.scratch_seeds > 0)
    num_train = data.counts()["num_train_pairs"]
    results, unfinished = tune_and_run(args, runner, make_cells(args, num_train), methods)
    if args.scratch_seeds > 0:
        scratch = scratch_cell(args, runner, results, methods, num_train)
        results += [scratch] if scratch is not None else []
    runner.close()
    meta = {
        **data.counts(),
        "train_artists": args.train_artists,
        "heldout_artist": args.heldout_artist,
        "val_fraction": args.val_fraction,
        "lr": args.lr,
        "weight_decay": 0.1,
        "warmup_fraction": WARMUP_FRACTION,
        "heads": args.heads,
        "seeds": args.seeds,
        "tune_seeds": args.tune_seeds,
        "eval_points": args.eval_points,
        "scratch_seeds": args.scratch_seeds,
        "scratch_epochs": args.scratch_epochs,
        "gamma_decay_fraction": GAMMA_DECAY_FRACTION,
        "workers": args.workers,
        "quick": args.quick,
        "methods": {m.name: {"fields": m.fields, "grid": m.grid, "note": m.note} for m in methods},
        "skipped_methods": skipped,
        "unfinished": unfinished,
        "cached_only": args.cached_only,
        "num_concepts": args.num_concepts,
        "knobs_from": args.knobs_from,
        "long_knobs_from": args.long_knobs_from,
        "wall_s": round(time.monotonic() - start, 1),
    }
    report = {"config": meta, "results": results, "targets": cr.targets(results)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    for regime in dict.fromkeys(c["regime"] for c in results):
        cr.plot(results, regime, out.with_name(f"{out.stem}_{regime}.png"))
    text = cr.markdown(report, out.stem)
    out.with_suffix(".md").write_text(text)
    print(text)
    return report
