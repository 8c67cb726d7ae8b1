"""Which objective trains best at a small global batch: tuned, paired-seed evidence on held-out drawings.

Data (``emoji_artists``): the ~1,900 emoji concepts captioned with their Unicode names, drawn by four
artists from the package registries. The heads train on three artists (Twemoji, Noto, Fluent: ~5,100
pairs) and are scored on the fourth (OpenMoji), never trained on: retrieval R@1 between its drawings
and the captions (clip-benchmark's definition; image→text and text→image, and their mean). Tuning
never sees OpenMoji: a validation split holds back, from each training artist, the drawings of a
disjoint share of the concepts (``--val-fraction``; the other artists' drawings of them stay in
training, so validation asks what the test asks — a new drawing of a known concept).

Main regime, LiT: frozen EfficientNet-Lite0 and MiniLM towers (features computed once and cached), two
linear heads and τ trained — seconds per run — with the trainer's own pieces: ``toolkit.train.model``
(heads initialised as ``toolkit train --seed`` does), ``build_loss``, ``build_optimizer``, the lr and τ
rules, ``step.forward_backward`` and the global batch order ``BatchOrder``. Every method of a cell runs
the same batches from the same initial heads per seed, so differences are paired.

Cells: two regimes — short (``--short-epochs``, default 6) and long (``--long-epochs``, default 30) —
times global batches 32, 64, 256. In each cell every method (``convergence_methods.METHODS``: a name,
its LossConfig fields and its tuning grid) is tuned on validation with ``--tune-seeds`` seeds (a
coordinate search whose grids are extended past any end that wins), then its chosen setting runs on
``--seeds`` paired seeds (the tuning seeds' runs are reused). Reported per cell
(``convergence_report``): held-out R@1 mean ± std, paired Δ against the best OpenCLIP (the OpenCLIP
variant with the better validation score), whether Δ > 2 std, and the steps needed to reach the best
OpenCLIP's final score. Each finished run is kept in ``CACHE/runs.jsonl`` (keyed by everything that
defines it), so an interrupted benchmark resumes and a new method costs only its own runs; ``--fresh``
ignores the cache (do that after changing an objective's code).

    PYTHONPATH=$PWD python benchmarks/convergence.py                # full: ~1 h with 2 workers here
    PYTHONPATH=$PWD python benchmarks/convergence.py --quick        # smoke run: 1 cell, 2 seeds

Writes ``--out`` (JSON), the same path with ``.md`` (tables, targets), and ``<stem>_<regime>.png``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import convergence_methods as cm  # noqa: E402
import convergence_report as cr  # noqa: E402

RUN_CACHE_VERSION = 1  # bump when the run procedure changes (invalidates CACHE/runs.jsonl)
GAMMA_DECAY_FRACTION = 18 / 37  # the CC3M FastCLIP preset decays γ over 18 of its 37 epochs
SPLIT_SEED = 20240607  # which concepts each training artist holds back for validation (fixed)
WARMUP_FRACTION = 0.1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", default="runs/convergence", help="features, npm packages and finished runs")
    p.add_argument("--train-artists", nargs="+", default=["twemoji", "noto", "fluent"])
    p.add_argument("--heldout-artist", default="openmoji")
    p.add_argument("--heads", default="cliptk-small", help="model config whose embed_dim the heads project to")
    p.add_argument("--batches", type=int, nargs="+", default=[32, 64, 256])
    p.add_argument("--short-epochs", type=int, default=6)
    p.add_argument("--long-epochs", type=int, default=30)
    p.add_argument("--regimes", nargs="+", default=["short", "long"], choices=["short", "long"])
    p.add_argument("--seeds", type=int, default=5, help="paired seeds per tuned method")
    p.add_argument("--tune-seeds", type=int, default=1, help="seeds per grid point on validation")
    p.add_argument("--methods", nargs="*", default=None, help="method names (default: every available one)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--val-fraction", type=float, default=0.15)
    p.add_argument("--eval-points", type=int, default=20, help="evaluations per run (the curves' resolution)")
    p.add_argument("--workers", type=int, default=2, help="processes (one torch thread each)")
    p.add_argument("--fresh", action="store_true", help="ignore finished runs in CACHE/runs.jsonl")
    p.add_argument("--quick", action="store_true", help="smoke run: batch 32, short regime of 2 epochs, "
                   "2 seeds, 4 evaluations")
    p.add_argument("--out", default="benchmarks/results/convergence.json")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.regimes, args.short_epochs = [32], ["short"], 2
        args.seeds, args.tune_seeds, args.eval_points = 2, 1, 4
    if args.tune_seeds > args.seeds:
        p.error("--tune-seeds must not exceed --seeds")
    return args


# ------------------------------------------------------------------------------------------ data
class Data:
    """Training pairs (float16 features, as precompute stores them), validation and held-out sets."""

    def __init__(self, args: argparse.Namespace):
        import emoji_artists

        feats, caps = emoji_artists.load_all([*args.train_artists, args.heldout_artist], Path(args.cache))
        where = {c: i for i, c in enumerate(caps.codepoints)}
        order = np.random.default_rng(SPLIT_SEED).permutation(len(caps.codepoints))
        num_val = round(len(order) * args.val_fraction)
        # the k-th validation concept is held back from training artist k mod A (the others keep theirs)
        held_back = {int(c): args.train_artists[k % len(args.train_artists)] for k, c in enumerate(order[:num_val])}
        train, val = ([], []), ([], [])
        for artist in args.train_artists:
            f = feats[artist]
            for row, code in enumerate(f.codepoints):
                side = val if held_back.get(where[code]) == artist else train
                side[0].append(f.image[row])
                side[1].append(caps.text[where[code]])
        held = feats[args.heldout_artist]
        self.train = tuple(np.stack(s).astype(np.float16) for s in train)
        self.val = tuple(np.stack(s).astype(np.float16) for s in val)
        self.held = (held.image.astype(np.float16), caps.text[[where[c] for c in held.codepoints]].astype(np.float16))
        self.num_train, self.num_val, self.num_held = len(self.train[0]), len(self.val[0]), len(self.held[0])
        digest = hashlib.sha1()
        for a in (*self.train, *self.val, *self.held):
            digest.update(np.ascontiguousarray(a).tobytes())
        self.signature = digest.hexdigest()[:16]

    def counts(self) -> dict[str, int]:
        return {"num_train_pairs": self.num_train, "num_val_pairs": self.num_val, "num_heldout_pairs": self.num_held}


# ------------------------------------------------------------------------------------------ one run
class Bench:
    """One worker's data and per-seed initial heads; ``run`` trains one (loss, batch, steps, seed)."""

    def __init__(self, args: argparse.Namespace):
        import torch

        from toolkit.data.trainset.format import Field, TrainDataset
        from toolkit.models import frozen

        torch.set_num_threads(1)  # heads are small: one thread per worker, workers in parallel
        self.args, self.data = args, Data(args)
        self.tensors = {name: tuple(torch.from_numpy(a) for a in getattr(self.data, name))
                        for name in ("train", "val", "held")}
        towers = {"image_tower": {"kind": "efficientnet_lite0", "image_size": 224, "weights": "",
                                  "mean": list(frozen.LITE_MEAN), "std": list(frozen.LITE_STD)},
                  "text_tower": {"kind": "minilm", "context_length": frozen.MINILM_CONTEXT_LENGTH, "weights": ""}}
        fields = [Field.make("image_features", (frozen.LITE0_DIM,)), Field.make("text_features", (frozen.MINILM_DIM,))]
        # the training set as the trainer sees it (dataset.json's content; the features are in memory)
        self.dataset = TrainDataset(self.data.num_train, fields, [], 1, extra=towers, root=args.cache)
        self.models: dict[int, object] = {}

    def model(self, seed: int, loss_cfg):
        """The trainer's model for ``seed`` (heads as ``toolkit train --seed``), τ reset to tau_init."""
        import torch

        from toolkit.train import model as model_lib

        if seed not in self.models:
            built = model_lib.build(self.args.heads, "", self.dataset, loss_cfg.tau_init, True, seed)
            init = {k: v.detach().clone() for k, v in built.model.named_parameters() if v.requires_grad}
            self.models[seed] = (built.model, init)
        model, init = self.models[seed]
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in init.items():
                params[name].copy_(value)
            model.clip.logit_scale.fill_(math.log(1.0 / loss_cfg.tau_init))
        model.clip.logit_scale.requires_grad_(loss_cfg.learns_logit_scale)
        return model

    def scores(self, model, split: str) -> tuple[float, float]:
        """(image→text, text→image) R@1 on a split whose row i image goes with row i caption."""
        import torch
        from torch.nn.functional import normalize

        image, text = self.tensors[split]
        model.eval()
        with torch.no_grad():
            x, y = normalize(model.encode_image(image), dim=-1), normalize(model.encode_text(text), dim=-1)
        model.train()
        return recall_at_1(x, y)

    def run(self, loss_cfg, batch: int, steps: int, seed: int) -> dict:
        """Train ``steps`` steps; held-out and validation R@1 at ``eval_steps``."""
        import torch

        from toolkit.data.trainset.order import BatchOrder
        from toolkit.train.optim import OptimConfig

        start = time.monotonic()
        model = self.model(seed, loss_cfg)
        optim = OptimConfig(lr=self.args.lr, weight_decay=0.1, warmup_steps=int(steps * WARMUP_FRACTION))
        loop = HeadLoop(model, loss_cfg, optim, self.data.num_train, batch, steps)
        order = BatchOrder(self.data.num_train, batch, seed)
        evals = set(eval_steps(steps, self.args.eval_points))
        image, text = self.tensors["train"]
        curve = {"step": [], "heldout": [], "val": []}
        for t in range(steps):
            ids = torch.from_numpy(order.batch_ids(t))
            loop.step(t, image[ids], text[ids], ids, seed)
            if t + 1 in evals:
                curve["step"].append(t + 1)
                curve["heldout"].append(self.scores(model, "held"))
                curve["val"].append(self.scores(model, "val"))
        curve["tau"] = loop.tau()
        curve["skipped_steps"] = loop.skipped
        curve["wall_s"] = time.monotonic() - start
        return curve


class HeadLoop:
    """The trainer's step sequence on one process (``toolkit.train.loop.train_step`` with ``Setup``'s
    set_lr / optimizer_step / skip_step): schedules, forward/backward, non-finite check, the update or a
    skip, τ clamp. Kept here only until the trainer's parts can be called directly."""

    def __init__(self, model, loss_cfg, optim_cfg, data_size: int, batch: int, total_steps: int):
        from toolkit.train.losses import build_loss
        from toolkit.train.losses.temperature import TemperatureControl
        from toolkit.train.optim import build_optimizer, logit_scale_group

        self.model, self.loss_cfg, self.optim_cfg, self.total_steps = model, loss_cfg, optim_cfg, total_steps
        self.loss_fn = build_loss(loss_cfg, data_size=data_size, check_sizes=False)
        self.optimizer = build_optimizer(model.clip, optim_cfg, loss_cfg.lr_tau)
        group = logit_scale_group(self.optimizer)
        self.tau_ctl = None if group is None else TemperatureControl(
            model.clip.logit_scale, group, lr_tau=loss_cfg.lr_tau or optim_cfg.lr, schedule=loss_cfg.lr_tau_schedule)
        self.steps_per_epoch = max(1, data_size // batch)  # as the trainer's steps_per_epoch
        self.skipped = 0

    def step(self, t: int, image, text, ids, seed: int) -> None:
        import contextlib

        import torch

        from toolkit.train.schedule import set_lr
        from toolkit.train.step import StepInputs, forward_backward, stream_seed

        self.loss_fn.begin_step(t, self.steps_per_epoch)
        set_lr(self.optimizer, t, self.total_steps, self.optim_cfg)
        if self.tau_ctl is not None and self.loss_cfg.lr_tau_schedule != "cosine":
            self.tau_ctl.before_step(t)
        forward_backward(self.model, self.loss_fn, StepInputs(image, text, ids), micro_batch_size=0,
                         seed_of=lambda i: stream_seed(seed, t, 0, i), autocast=contextlib.nullcontext)
        value = float(self.loss_fn.global_value())
        params = [p for p in self.model.clip.parameters() if p.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, math.inf)) if params else 0.0
        if math.isfinite(value) and math.isfinite(grad_norm):
            self.optimizer.step()
            self.loss_fn.end_step(applied=True)
            if self.tau_ctl is not None:
                self.tau_ctl.after_step()
        else:
            self.loss_fn.end_step(applied=False)
            self.skipped += 1
        self.optimizer.zero_grad(set_to_none=True)

    def tau(self) -> float:
        return self.loss_fn.temperature(self.model.clip.logit_scale.detach().exp())


def recall_at_1(image_emb, text_emb) -> tuple[float, float]:
    """(image→text, text→image) R@1 with one caption per image (row i with row i), top-1 by torch.topk as
    clip-benchmark computes it."""
    import torch

    scores = text_emb @ image_emb.T  # [T, M]
    truth = torch.arange(scores.shape[0])
    t2i = (scores.topk(1, dim=1).indices[:, 0] == truth).float().mean().item()
    i2t = (scores.T.topk(1, dim=1).indices[:, 0] == truth).float().mean().item()
    return i2t, t2i


def eval_steps(steps: int, points: int) -> list[int]:
    return sorted({max(1, round(steps * k / points)) for k in range(1, points + 1)})


# ------------------------------------------------------------------------------------------ orchestration
_BENCH: Bench | None = None


def _init_worker(args: argparse.Namespace) -> None:
    global _BENCH
    _BENCH = Bench(args)


def _run_task(task: dict) -> tuple[str, dict]:
    cfg = cm.loss_config(task["fields"], task["method"])
    return task["key"], _BENCH.run(cfg, task["batch"], task["steps"], task["seed"])


class Runner:
    """Runs training tasks on ``--workers`` processes; finished runs are appended to CACHE/runs.jsonl."""

    def __init__(self, args: argparse.Namespace, data: Data):
        self.args, self.path = args, Path(args.cache) / "runs.jsonl"
        self.common = {"version": RUN_CACHE_VERSION, "data": data.signature, "lr": args.lr, "heads": args.heads,
                       "eval_points": args.eval_points, "warmup_fraction": WARMUP_FRACTION}
        self.done: dict[str, dict] = {}
        if self.path.is_file() and not args.fresh:
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a kill
                    continue
                self.done[rec["key"]] = rec["curve"]
        self.started = time.monotonic()

    def task(self, cell: dict, method: cm.Method, knobs: dict, seed: int) -> dict:
        fields = {**method.fields, "gamma_decay_epochs": cell["gamma_decay_epochs"], **knobs}
        ident = {**self.common, "fields": fields, "batch": cell["batch"], "steps": cell["steps"], "seed": seed}
        key = hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
        return {"key": key, "method": method.name, "fields": fields, "batch": cell["batch"], "steps": cell["steps"],
                "seed": seed, "label": f"{cell['regime']} b{cell['batch']} {method.name} {cm.describe(knobs)} s{seed}"}

    def run_all(self, tasks: list[dict]) -> None:
        todo = list({t["key"]: t for t in tasks if t["key"] not in self.done}.values())
        todo.sort(key=lambda t: -t["steps"] * (t["batch"] ** 0.5))  # longest first: the pool stays busy
        if not todo:
            return
        labels = {t["key"]: t["label"] for t in todo}
        if self.args.workers <= 1:
            _init_worker(self.args) if _BENCH is None else None
            results = map(_run_task, todo)
            self._collect(results, labels)
            return
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(self.args.workers, initializer=_init_worker, initargs=(self.args,)) as pool:
            self._collect(pool.imap_unordered(_run_task, todo), labels)

    def _collect(self, results, labels: dict[str, str]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:
            for i, (key, curve) in enumerate(results, 1):
                self.done[key] = curve
                fh.write(json.dumps({"key": key, "curve": curve}) + "\n")
                fh.flush()
                print(f"[{i}/{len(labels)}] {labels[key]}: val {100 * cr.mean_r1(curve['val'][-1]):.2f} held-out "
                      f"{100 * cr.mean_r1(curve['heldout'][-1]):.2f} ({curve['wall_s']:.0f} s; "
                      f"{time.monotonic() - self.started:.0f} s in all)", flush=True)


def make_cells(args: argparse.Namespace, num_train: int) -> list[dict]:
    cells = []
    for regime in args.regimes:
        epochs = args.short_epochs if regime == "short" else args.long_epochs
        for batch in args.batches:
            per_epoch = max(1, num_train // batch)  # the trainer's steps_per_epoch
            cells.append({"regime": regime, "batch": batch, "epochs": epochs, "steps_per_epoch": per_epoch,
                          "steps": epochs * per_epoch,
                          "gamma_decay_epochs": max(1, round(epochs * GAMMA_DECAY_FRACTION))})
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


def tune_and_run(args: argparse.Namespace, runner: Runner, cells: list[dict], methods: list[cm.Method]) -> list[dict]:
    """Tune every method in every cell on validation, run the chosen settings on all seeds, summarise."""
    searches = {(i, m.name): (cells[i], m, cm.Search(m)) for i in range(len(cells)) for m in methods}
    tune_seeds = range(args.tune_seeds)
    while True:
        pending = [(cell, m, s, knobs) for cell, m, s in searches.values() for knobs in s.pending()]
        if not pending:
            break
        runner.run_all([runner.task(cell, m, knobs, seed) for cell, m, s, knobs in pending for seed in tune_seeds])
        for cell, m, s, knobs in pending:
            s.record(knobs, cr.val_score([runner.done[runner.task(cell, m, knobs, seed)["key"]] for seed in tune_seeds]))
        for _, _, s in searches.values():
            s.advance()
    final = {k: [runner.task(cell, m, s.best, seed) for seed in range(args.seeds)] for k, (cell, m, s) in searches.items()}
    runner.run_all([t for ts in final.values() for t in ts])
    out = []
    for i, cell in enumerate(cells):
        runs = {m.name: [runner.done[t["key"]] for t in final[(i, m.name)]] for m in methods}
        reports = {m.name: searches[(i, m.name)][2].report() for m in methods}
        out.append(cr.summarise(cell, runs, reports, [m.name for m in methods if m.is_openclip]))
    return out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.monotonic()
    data = Data(args)  # computes and caches the tower features before any worker starts
    methods, skipped = select_methods(args.methods)
    for name, why in skipped.items():
        print(f"skipping {name}: {why}", flush=True)
    if not any(m.is_openclip for m in methods):
        raise SystemExit("at least one OpenCLIP method is needed as the reference")
    cells = make_cells(args, data.num_train)
    results = tune_and_run(args, Runner(args, data), cells, methods)
    meta = {**data.counts(), "train_artists": args.train_artists, "heldout_artist": args.heldout_artist,
            "val_fraction": args.val_fraction, "lr": args.lr, "weight_decay": 0.1, "warmup_fraction": WARMUP_FRACTION,
            "heads": args.heads, "seeds": args.seeds, "tune_seeds": args.tune_seeds, "eval_points": args.eval_points,
            "gamma_decay_fraction": GAMMA_DECAY_FRACTION, "workers": args.workers, "quick": args.quick,
            "methods": {m.name: {"fields": m.fields, "grid": m.grid, "note": m.note} for m in methods},
            "skipped_methods": skipped, "wall_s": round(time.monotonic() - start, 1)}
    report = {"config": meta, "results": results, "targets": cr.targets(results)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    for regime in args.regimes:
        cr.plot(results, regime, out.with_name(f"{out.stem}_{regime}.png"))
    text = cr.markdown(report, out.stem)
    out.with_suffix(".md").write_text(text)
    print(text)
    return report


if __name__ == "__main__":
    main()
