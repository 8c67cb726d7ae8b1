"""Does a reference model that saw less data help? The convergence benchmark's cells, with students that read
a cliptk-trained reference's embeddings (``python -m benchmarks.objectives.reference``).

1. The reference (``teacher``): LiT heads trained on a subset of the training artists
   (``--reference-artists``, default Twemoji of Twemoji, Noto, Fluent) with the best-tuned OpenCLIP knobs of
   the convergence result
   (``--knobs-from``), trained out (``--reference-epochs``, default 30); then the reference pass embeds every
   training pair (timed, with the frozen towers'
   cost measured on a sample). Its own held-out R@1 is reported.
2. Students on all training artists, per (regime, batch) cell: every reference-reading method (``methods``:
   drrho, and distill where registered) tuned on validation (drrho: β and τ; ρ and lr_tau are v3's tuned ones)
   as the convergence benchmark tunes (coordinate
   search, grids extended past a winning end), then run on ``--seeds`` paired seeds; beside them, on the same
   seeds, the cell's best OpenCLIP with the knobs tuned by the convergence benchmark (not retuned here) and
   drrho with β = 0 (the same loss without the reference). The long regime reuses the short regime's knobs.
3. The from-scratch cell (cliptk-tiny on 32 px pixels, batch 64, ``--scratch-epochs``): the best OpenCLIP and
   the ``--scratch-methods`` rows with the LiT short batch-64 knobs, the reference's embeddings as the
   teacher;
   with ``--scratch-tune``, distill's λ (and the teacher's τ) are tuned on this cell's own validation split
   instead (a student far weaker than its teacher wants another λ than the LiT heads).

Targets (issue 33): ≥ +3 R@1 points over the best OpenCLIP in the LiT cells; ≥ 5× OpenCLIP's R@1 from scratch.

    python -m benchmarks.objectives.reference              # LiT short at batch 32 and 64, scratch cell
    python -m benchmarks.objectives.reference --quick      # smoke run
    python -m benchmarks.objectives.reference --methods distill   # needs the distill objective registered
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.objectives.convergence import methods as cm
from benchmarks.objectives.convergence import report as cr
from benchmarks.objectives.convergence.main import make_cells, tune
from benchmarks.objectives.convergence.runs import WARMUP_FRACTION, Data
from benchmarks.objectives.reference import methods as rm
from benchmarks.objectives.reference import report as rr
from benchmarks.objectives.reference.bench import RefRunner
from benchmarks.objectives.reference.teacher import Reference, fit_by_artist, time_towers, train_reference


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--cache", default="runs/convergence", help="the convergence benchmark's cache (features, runs)"
    )
    p.add_argument("--train-artists", nargs="+", default=["twemoji", "noto", "fluent"])
    p.add_argument("--heldout-artist", default="openmoji")
    p.add_argument(
        "--reference-artists",
        nargs="+",
        default=["twemoji"],
        help="the reference's training artists "
        "(a subset of --train-artists: the reference sees less data than the students)",
    )
    p.add_argument(
        "--reference-batch",
        type=int,
        default=64,
        help="the reference's batch (its OpenCLIP knobs come "
        "from this batch's short-regime cell of --knobs-from)",
    )
    p.add_argument(
        "--reference-epochs",
        type=int,
        default=30,
        help="epochs of the reference over its own subset "
        "(default: the long regime's, so the reference is trained out, as a model a user already has)",
    )
    p.add_argument(
        "--reference-file",
        default=None,
        help="where the reference's embeddings are kept (default "
        "CACHE/reference_<artists>_b<batch>.npz; delete it to retrain the reference)",
    )
    p.add_argument(
        "--knobs-from",
        default="benchmarks/objectives/results/convergence.json",
        help="the convergence "
        "result whose cells give the best OpenCLIP and its tuned knobs, and FastCLIP v3's tuned knobs",
    )
    p.add_argument("--heads", default="cliptk-small")
    p.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    p.add_argument("--regimes", nargs="+", default=["short"], choices=["short", "long"])
    p.add_argument("--short-epochs", type=int, default=6)
    p.add_argument("--long-epochs", type=int, default=30)
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--tune-seeds", type=int, default=1)
    p.add_argument(
        "--methods", nargs="*", default=None, help=f"of {', '.join(rm.KNOWN)} (default: the registered ones)"
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--val-fraction", type=float, default=0.15)
    p.add_argument("--num-concepts", type=int, default=None)
    p.add_argument("--eval-points", type=int, default=20)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--fresh", action="store_true", help="ignore finished runs in CACHE/runs.jsonl")
    p.add_argument("--cached-only", action="store_true", help="train no student: report finished runs only")
    p.add_argument(
        "--scratch-seeds", type=int, default=3, help="seeds of the from-scratch cell (0: leave it out)"
    )
    p.add_argument("--scratch-epochs", type=int, default=4)
    p.add_argument(
        "--scratch-methods",
        nargs="+",
        default=["drrho", rm.CONTROL],
        help="the reference-reading "
        "rows of the scratch cell (beside its best OpenCLIP; a scratch run costs ~30 LiT runs)",
    )
    p.add_argument(
        "--scratch-tune",
        nargs="+",
        default=None,
        choices=rm.SCRATCH_KNOBS,
        metavar="KNOB",
        help="tune the scratch cell's distill row on that cell's own validation split (--tune-seeds runs "
        f"per grid point; a winning grid end is extended): distill.weight over {rm.SCRATCH_WEIGHTS} and, if "
        "named, "
        "distill.teacher_tau over half, once and twice the reference's τ (default: reuse the LiT "
        "batch-64 cell's knobs; other scratch rows always reuse them)",
    )
    p.add_argument(
        "--tower-timing-pairs",
        type=int,
        default=32,
        help="drawings and captions through the frozen towers to time them (0: skip)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: batch 32, 2 epochs, 2 seeds, 4 evaluations, no scratch cell, no tower timing",
    )
    p.add_argument("--out", default="benchmarks/objectives/results/reference.json")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.regimes, args.short_epochs, args.reference_batch = [32], ["short"], 2, 32
        args.reference_epochs = 2
        args.seeds, args.tune_seeds, args.eval_points, args.scratch_seeds, args.tower_timing_pairs = (
            2,
            1,
            4,
            0,
            0,
        )
    if args.scratch_tune and "distill.weight" not in args.scratch_tune:
        p.error(
            "--scratch-tune: distill.weight is always tuned; name it (distill.teacher_tau only beside it)"
        )
    if not set(args.reference_artists) < set(args.train_artists):
        p.error(
            "--reference-artists must be a proper subset of --train-artists (the reference sees less data)"
        )
    args.reference_file = args.reference_file or str(
        Path(args.cache)
        / f"reference_{'_'.join(args.reference_artists)}_b{args.reference_batch}_e{args.reference_epochs}.npz"
    )
    args.long_batches = args.long_methods = None  # as the convergence benchmark's make_cells reads them
    return args


def source_cell(knobs: dict, regime: str, batch: int) -> dict:
    """The (regime, batch) cell of the --knobs-from result (the short regime's for the scratch cell)."""
    cell = next((c for c in knobs["results"] if c["regime"] == regime and c["batch"] == batch), None)
    if cell is None:
        raise SystemExit(f"--knobs-from {knobs['path']}: no {regime} cell at batch {batch}")
    return cell


def best_openclip(knobs: dict, regime: str, batch: int) -> tuple[cm.Method, dict]:
    """(method, tuned knobs) of the best OpenCLIP of a --knobs-from cell."""
    cell = source_cell(knobs, regime, batch)
    method = next(m for m in cm.METHODS if m.name == cell["best_openclip"])
    return method, cell["rows"][method.name]["tuning"]["chosen"]


def lit_searches(args, cells: list[dict], knobs: dict, names: list[str], ref: Reference) -> dict:
    """{(cell index, method name): (cell, method, Search)} of the LiT cells: the best OpenCLIP adopted from
    --knobs-from, drrho started from v3's tuned τ (its lr_tau and ρ kept), distill from the best OpenCLIP."""
    searches = {}
    for i, cell in enumerate(cells):
        openclip, chosen = best_openclip(knobs, cell["regime"], cell["batch"])
        searches[(i, openclip.name)] = (cell, openclip, cm.Search(openclip))
        searches[(i, openclip.name)][2].adopt(
            chosen, f"convergence benchmark's {cell['regime']} regime ({knobs['path']})"
        )
        v3 = (
            source_cell(knobs, cell["regime"], cell["batch"])["rows"].get("fastclip-v3", {}).get("tuning", {})
        )
        for name in names:
            method = (
                rm.drrho(args.quick)
                if name == "drrho"
                else rm.distill({**openclip.fields, **chosen}, ref.meta["curve"]["tau"])
            )
            search = cm.Search(method)
            if name == "drrho":
                search.inherit({k: v for k, v in v3.get("chosen", {}).items() if k in ("lr_tau", "rho")})
                search.best.update(
                    {
                        k: v
                        for k, v in v3.get("chosen", {}).items()
                        if k in search.grids and v in search.grids[k]
                    }
                )
            searches[(i, name)] = (cell, method, search)
    return searches


def run_cells(args, runner: RefRunner, cells: list[dict], searches: dict) -> tuple[list[dict], list[str]]:
    """Tune (long cells adopt their short cell's chosen knobs), run every seed, add the β = 0 control,
    summarise each cell. Returns (cells, unfinished)."""
    unfinished = tune(args, runner, {k: v for k, v in searches.items() if v[0]["regime"] == "short"})
    short = {c["batch"]: i for i, c in enumerate(cells) if c["regime"] == "short"}
    for (i, name), (cell, _, search) in searches.items():
        if cell["regime"] == "long" and not search.adopted_from:
            source = (short.get(cell["batch"]), name)
            if source not in searches or source in unfinished:
                unfinished.add((i, name))  # the long regime only reuses the short regime's tuning
            else:
                search.inherit(searches[source][2].inherited)
                search.adopt(searches[source][2].best, "short regime (here)")
    for (i, name), (cell, _, search) in list(searches.items()):
        if name == "drrho" and (i, name) not in unfinished:
            ctrl = cm.Search(rm.control())
            ctrl.adopt({**search.inherited, **search.best, "drrho.ref_weight": 0.0}, "drrho row of the cell")
            searches[(i, rm.CONTROL)] = (cell, ctrl.method, ctrl)
    return finish(args, runner, cells, searches, unfinished, args.seeds)


def finish(args, runner: RefRunner, cells: list[dict], searches: dict, unfinished: set, seeds: int):
    """Run every search's chosen setting on ``seeds`` seeds and summarise each cell against its OpenCLIP."""
    final = {
        k: [runner.task(cell, m, {**s.inherited, **s.best}, seed) for seed in range(seeds)]
        for k, (cell, m, s) in searches.items()
        if k not in unfinished
    }
    runner.run_all([t for ts in final.values() for t in ts])
    unfinished |= {k for k, ts in final.items() if any(t["key"] not in runner.done for t in ts)}
    out = []
    for i, cell in enumerate(cells):
        names = [n for (j, n) in searches if j == i and (j, n) not in unfinished]
        openclip = [n for n in names if searches[(i, n)][1].is_openclip]
        if openclip:
            out.append(
                cr.summarise(
                    cell,
                    {n: runner.curves(final[(i, n)]) for n in names},
                    {n: searches[(i, n)][2].report() for n in names},
                    openclip,
                )
            )
    return out, sorted(f"{cells[i]['regime']} batch {cells[i]['batch']}: {n}" for i, n in unfinished)


def scratch_cell(
    args, runner: RefRunner, lit: dict, knobs: dict, num_train: int, teacher_tau: float
) -> tuple[list[dict], list[str]]:
    """The from-scratch cliptk-tiny cell at batch 64: the best OpenCLIP of the short batch-64 cell of
    --knobs-from, and the --scratch-methods rows with the knobs tuned here in the LiT short batch-64 cell,
    except distill under --scratch-tune: tuned on this cell's own validation split (its teacher: the
    reference, τ ``teacher_tau``), as the LiT cells tune, with --tune-seeds seeds per point."""
    ns = argparse.Namespace(
        **{
            **vars(args),
            "regimes": ["short"],
            "batches": [64],
            "short_epochs": args.scratch_epochs,
            "seeds": args.scratch_seeds,
        }
    )
    cell = {
        **make_cells(ns, num_train)[0],
        "regime": "scratch",
        "mode": "scratch",
        "model": "cliptk-tiny",
        "knobs_from": "LiT short, batch 64",
    }
    openclip, chosen = best_openclip(knobs, "short", 64)
    searches = {(0, openclip.name): (cell, openclip, cm.Search(openclip))}
    searches[(0, openclip.name)][2].adopt(
        chosen, f"convergence benchmark's LiT short regime ({knobs['path']})"
    )
    for name in args.scratch_methods:
        if name == "distill" and args.scratch_tune:
            method = rm.distill_scratch({**openclip.fields, **chosen}, teacher_tau, args.scratch_tune)
            searches[(0, name)] = (cell, method, cm.Search(method))
        elif name in lit:
            search = cm.Search(lit[name].method)
            search.adopt({**lit[name].inherited, **lit[name].best}, "LiT short regime's batch-64 cell (here)")
            searches[(0, name)] = (cell, lit[name].method, search)
    unfinished = tune(ns, runner, searches) if args.scratch_tune else set()
    return finish(args, runner, [cell], searches, unfinished, args.scratch_seeds)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.monotonic()
    names, skipped = rm.choose(args.methods)
    for name, why in skipped.items():
        print(f"skipping {name}: {why}", flush=True)
    knobs = {**json.loads(Path(args.knobs_from).read_text()), "path": args.knobs_from}
    data = Data(args, scratch=args.scratch_seeds > 0)  # computes and caches the features before any worker
    path = Path(args.reference_file)
    if path.is_file() and not args.fresh:
        ref = Reference.load(path)
    else:
        openclip, chosen = best_openclip(knobs, "short", args.reference_batch)
        ref = train_reference(args, {"method": openclip.name, "fields": {**openclip.fields, **chosen}})
        ref.save(path)
    print(
        f"reference: {ref.meta['artists']} ({ref.meta['num_train_pairs']} pairs), held-out R@1 "
        f"{100 * cr.mean_r1(ref.meta['curve']['heldout'][-1]):.2f}; pass over {ref.meta['num_pass_pairs']} "
        "pairs "
        f"{ref.meta['heads_pass_s']:.2f} s",
        flush=True,
    )
    towers = time_towers(Path(args.cache), args.tower_timing_pairs) if args.tower_timing_pairs > 0 else {}
    runner = RefRunner(args, data, ref, args.scratch_seeds > 0, rm.READS_REFERENCE)
    num_train = data.counts()["num_train_pairs"]
    cells = make_cells(args, num_train)
    searches = lit_searches(args, cells, knobs, names, ref)
    results, unfinished = run_cells(args, runner, cells, searches)
    if args.scratch_seeds > 0:
        i64 = next((i for i, c in enumerate(cells) if c["regime"] == "short" and c["batch"] == 64), None)
        lit = {} if i64 is None else {n: s for (i, n), (_, _, s) in searches.items() if i == i64}
        scratch, left = scratch_cell(args, runner, lit, knobs, num_train, ref.meta["curve"]["tau"])
        results, unfinished = results + scratch, unfinished + left
    runner.close()
    report = rr.build(
        args, data.counts(), ref, towers, results, skipped, unfinished, time.monotonic() - start
    )
    report["reference"]["fit_by_artist"] = fit_by_artist(ref, data.pairs["train"], args.reference_batch)
    report["config"]["warmup_fraction"] = WARMUP_FRACTION
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    for regime in dict.fromkeys(c["regime"] for c in results):
        cr.plot(results, regime, out.with_name(f"{out.stem}_{regime}.png"))
    text = rr.markdown(report, out.stem)
    out.with_suffix(".md").write_text(text)
    print(text)
    return report
