"""One training run of the convergence benchmark, and the worker pool with its run cache.

``Data``: the pairs of the training artists (minus the validation drawings), the validation pairs and
the held-out artist's pairs, as LiT features (float16, as precompute stores them) and, for the
from-scratch cell, as 32 px pixels and cliptk-tiny tokens. ``Bench.run`` trains one (mode, loss,
batch, steps, seed) and evaluates R@1 on validation and held-out along the way. ``Runner`` runs many
on ``--workers`` processes and appends each finished run to ``CACHE/runs.jsonl``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import time
from pathlib import Path

import numpy as np

from benchmarks.objectives.convergence import emoji_artists
from benchmarks.objectives.convergence import methods as cm
from benchmarks.objectives.convergence import report as cr

RUN_CACHE_VERSION = 1  # bump when the run procedure changes (invalidates CACHE/runs.jsonl)
SPLIT_SEED = 20240607  # which concepts each training artist holds back for validation (fixed)
WARMUP_FRACTION = 0.1
SCRATCH_MODEL = "cliptk-tiny"  # 32 px ViT and a 32-token text tower, trained from random init
SPLITS = ("train", "val", "held")


class Data:
    """Pairs per split (rows: (artist, row in that artist's features, caption index)) and their tensors per
    mode: ``sets[mode][split] = (image, text)`` numpy arrays, row i of image going with row i of text."""

    def __init__(self, args: argparse.Namespace, scratch: bool = False):
        cache = Path(args.cache)
        self.feats, caps = emoji_artists.load_all([*args.train_artists, args.heldout_artist], cache)
        where = {c: i for i, c in enumerate(caps.codepoints)}
        total = len(caps.codepoints)
        num = min(args.num_concepts or total, total)
        kept = np.asarray(
            [i * total // num for i in range(num)]
        )  # evenly over the Unicode order, as the demo
        order = kept[np.random.default_rng(SPLIT_SEED).permutation(num)]
        num_val = round(num * args.val_fraction)
        # the k-th validation concept is held back from training artist k mod A (the others keep theirs)
        held_back = {
            int(c): args.train_artists[k % len(args.train_artists)] for k, c in enumerate(order[:num_val])
        }
        keep = set(kept.tolist())
        self.pairs: dict[str, list[tuple[str, int, int]]] = {s: [] for s in SPLITS}
        for artist in [*args.train_artists, args.heldout_artist]:
            for row, code in enumerate(self.feats[artist].codepoints):
                if where[code] in keep:
                    split = (
                        "held"
                        if artist == args.heldout_artist
                        else "val"
                        if held_back.get(where[code]) == artist
                        else "train"
                    )
                    self.pairs[split].append((artist, row, where[code]))
        self.sets = {"lit": self._gather({a: f.image for a, f in self.feats.items()}, caps.text, np.float16)}
        if scratch:
            from toolkit.models.registry import tokenizer

            pixels = {a: emoji_artists.load_pixels(a, f.codepoints, 32, cache) for a, f in self.feats.items()}
            tokens = tokenizer(SCRATCH_MODEL)(caps.captions).numpy().astype(np.int32)
            self.sets["scratch"] = self._gather(pixels, tokens, None)
        digest = hashlib.sha1()
        for image, text in self.sets["lit"].values():
            digest.update(image.tobytes() + text.tobytes())
        self.signature = digest.hexdigest()[:16]

    def _gather(self, images: dict[str, np.ndarray], text: np.ndarray, dtype) -> dict[str, tuple]:
        out = {}
        for split, pairs in self.pairs.items():
            image = np.stack([images[a][row] for a, row, _ in pairs])
            txt = text[[c for _, _, c in pairs]]
            out[split] = (image, txt) if dtype is None else (image.astype(dtype), txt.astype(dtype))
        return out

    def counts(self) -> dict[str, int]:
        return {f"num_{s}_pairs": len(p) for s, p in self.pairs.items()}


class Bench:
    """One worker's data and per-(mode, seed) models; ``run`` trains one setting."""

    def __init__(self, args: argparse.Namespace, scratch: bool = False):
        import torch

        torch.set_num_threads(1)  # small models: one thread per worker, workers in parallel
        self.args, self.data = args, Data(args, scratch)
        self.tensors = {
            mode: {s: tuple(torch.from_numpy(a) for a in pair) for s, pair in sets.items()}
            for mode, sets in self.data.sets.items()
        }
        self.models: dict[tuple[str, int, bool], tuple] = {}

    def dataset(self, mode: str):
        """The training set as the trainer sees it (dataset.json's content; the arrays are in memory)."""
        from toolkit.data.trainset.format import Field, TrainDataset
        from toolkit.models import frozen

        image, text = self.data.sets[mode]["train"]
        if mode == "scratch":
            fields = [Field.make("image", image.shape[1:]), Field.make("tokens", text.shape[1:])]
            return TrainDataset(len(image), fields, [], 1, root=self.args.cache)
        towers = {
            "image_tower": {
                "kind": "efficientnet_lite0",
                "image_size": 224,
                "weights": "",
                "mean": list(frozen.LITE_MEAN),
                "std": list(frozen.LITE_STD),
            },
            "text_tower": {"kind": "minilm", "context_length": frozen.MINILM_CONTEXT_LENGTH, "weights": ""},
        }
        fields = [Field.make("image_features", image.shape[1:]), Field.make("text_features", text.shape[1:])]
        return TrainDataset(len(image), fields, [], 1, extra=towers, root=self.args.cache)

    def model(self, mode: str, seed: int, loss_cfg):
        """The trainer's built model (``BuiltModel``) for ``seed`` (as ``toolkit train --seed`` initialises
        it), τ at tau_init; built once per (mode, seed, logit bias), reset to its initial weights per call."""
        import torch

        from toolkit.train import model as model_lib

        bias = loss_cfg.init_logit_bias  # sigmoid losses: the model carries a learnable logit bias
        key = (mode, seed, bias is not None)
        if key not in self.models:
            built = model_lib.build(
                self.model_name(mode),
                "",
                self.dataset(mode),
                loss_cfg.initial_tau,
                True,
                seed,
                logit_bias=bias,
            )
            init = {k: v.detach().clone() for k, v in built.model.named_parameters() if v.requires_grad}
            self.models[key] = (built, init)
        built, init = self.models[key]
        model = built.model
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in init.items():
                params[name].copy_(value)
            model.clip.logit_scale.fill_(math.log(1.0 / loss_cfg.initial_tau))
            if bias is not None:
                model.clip.logit_bias.fill_(bias)
        model.clip.logit_scale.requires_grad_(loss_cfg.learns_logit_scale)
        return built

    def model_name(self, mode: str) -> str:
        return SCRATCH_MODEL if mode == "scratch" else self.args.heads

    def scores(self, model, mode: str, split: str) -> tuple[float, float]:
        """(image→text, text→image) R@1 of a split (one caption per image)."""
        import torch
        from torch.nn.functional import normalize

        image, text = self.tensors[mode][split]
        model.eval()
        with torch.no_grad():
            x = torch.cat([normalize(model.encode_image(c), dim=-1) for c in image.split(512)])
            y = torch.cat([normalize(model.encode_text(c), dim=-1) for c in text.split(512)])
        model.train()
        return recall_at_1(x, y)

    def run(self, mode: str, loss_cfg, batch: int, steps: int, seed: int) -> dict:
        """Train ``steps`` steps from seed ``seed``'s init; validation and held-out R@1 at ``eval_steps``."""
        import torch

        from toolkit.data.trainset.order import BatchOrder
        from toolkit.train.loop import train_step
        from toolkit.train.trainstate import TrainState

        start = time.monotonic()
        parts = self.parts(mode, loss_cfg, batch, steps, seed)
        image, text = self.tensors[mode]["train"]
        order = BatchOrder(len(image), batch, seed, parts.cfg.loader.shuffle_block)  # as the trainer's loader
        keys = ("image", "tokens") if mode == "scratch" else ("image_features", "text_features")
        evals, state = set(eval_steps(steps, self.args.eval_points)), TrainState()
        curve = {"step": [], "heldout": [], "val": []}
        for t in range(steps):  # one process: this rank's slice of global batch t is all of it
            ids = torch.from_numpy(order.batch_ids(t))
            train_step(
                parts,
                state,
                {"step": t, keys[0]: image[ids], keys[1]: text[ids], "index": ids, **self.batch_extras(ids)},
            )
            if t + 1 in evals:
                curve["step"].append(t + 1)
                curve["heldout"].append(self.scores(parts.built.model, mode, "held"))
                curve["val"].append(self.scores(parts.built.model, mode, "val"))
        return {
            **curve,
            "tau": parts.update.temperature(),
            "skipped_steps": state.skipped_steps,
            "wall_s": time.monotonic() - start,
        }

    def batch_extras(self, ids) -> dict:
        """More keys of the batch of training rows ``ids`` [b] (none here; the reference benchmark's
        subclass adds a reference model's embeddings ``ref_image``, ``ref_text``)."""
        return {}

    def parts(self, mode: str, loss_cfg, batch: int, steps: int, seed: int):
        """The trainer's ``loop.Parts`` of one process for this run, as ``build_parts`` makes them but around
        the in-memory training set (no process group, no loader, no checkpoints: nothing is saved)."""
        import torch

        from toolkit.train.batches import TrainData, step_counts
        from toolkit.train.checkpoint.state import StateIO
        from toolkit.train.config import TrainConfig
        from toolkit.train.loop import Parts
        from toolkit.train.losses import build_loss
        from toolkit.train.optim import OptimConfig
        from toolkit.train.runtime import Runtime
        from toolkit.train.update import Update

        optim = OptimConfig(lr=self.args.lr, weight_decay=0.1, warmup_steps=int(steps * WARMUP_FRACTION))
        # a tuning grid's extreme may diverge: its skipped steps are counted and reported, never an abort
        cfg = TrainConfig(
            data=str(self.args.cache),
            out=str(Path(self.args.cache) / "unsaved"),
            model=self.model_name(mode),
            batch_size=batch,
            steps=steps,
            seed=seed,
            device="cpu",
            max_nonfinite_steps=steps + 1,
            tensorboard=False,
            loss=loss_cfg,
            optim=optim,
        )
        rt = Runtime(rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
        dataset = self.dataset(mode)
        data = TrainData(cfg.data_plan(), rt, dataset)
        steps = step_counts(cfg.data_plan(), dataset.num_samples)
        built = self.model(mode, seed, loss_cfg)
        loss_fn = build_loss(loss_cfg, data_size=data.num_samples, check_sizes=False)
        update = Update(built.model.clip, loss_fn, optim, loss_cfg, steps.total, cfg.precision)
        io = StateIO(cfg, rt, steps, built, update, loss_fn)
        return Parts(cfg, rt, data, built, built.model, loss_fn, update, io, micro_batch_size=0)


def recall_at_1(image_emb, text_emb) -> tuple[float, float]:
    """(image→text, text→image) R@1 with row i's caption for row i's image, top-1 by torch.topk as
    clip-benchmark computes it."""
    import torch

    scores = text_emb @ image_emb.T  # [T, M]
    truth = torch.arange(scores.shape[0])
    t2i = (scores.topk(1, dim=1).indices[:, 0] == truth).float().mean().item()
    i2t = (scores.T.topk(1, dim=1).indices[:, 0] == truth).float().mean().item()
    return i2t, t2i


def eval_steps(steps: int, points: int) -> list[int]:
    return sorted({max(1, round(steps * k / points)) for k in range(1, points + 1)})


# ------------------------------------------------------------------------------------------ the pool
_BENCH: Bench | None = None


def _init_worker(args: argparse.Namespace, scratch: bool) -> None:
    global _BENCH
    _BENCH = Bench(args, scratch)


def _run_task(task: dict) -> tuple[str, dict]:
    cfg = cm.loss_config(task["fields"], task["method"])
    return task["key"], _BENCH.run(task["mode"], cfg, task["batch"], task["steps"], task["seed"])


class Runner:
    """Runs training tasks on ``--workers`` processes; finished runs are appended to CACHE/runs.jsonl."""

    def __init__(self, args: argparse.Namespace, data: Data, scratch: bool = False):
        self.args, self.path, self.scratch, self.pool = args, Path(args.cache) / "runs.jsonl", scratch, None
        self.common = {
            "version": RUN_CACHE_VERSION,
            "data": data.signature,
            "lr": args.lr,
            "heads": args.heads,
            "eval_points": args.eval_points,
            "warmup_fraction": WARMUP_FRACTION,
        }
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
        """The run of ``method`` with ``knobs`` in ``cell`` for ``seed``; its key names everything that
        defines the result."""
        decay = cell["epochs"] if method.gamma_over_all_epochs else cell["gamma_decay_epochs"]
        fields = {**method.fields, "gamma_decay_epochs": decay, **knobs}
        mode = cell.get("mode", "lit")
        ident = {
            **self.common,
            "mode": mode,
            "fields": fields,
            "batch": cell["batch"],
            "steps": cell["steps"],
            "seed": seed,
        }
        key = hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
        return {
            "key": key,
            "mode": mode,
            "method": method.name,
            "fields": fields,
            "batch": cell["batch"],
            "steps": cell["steps"],
            "seed": seed,
            "label": f"{cell['regime']} b{cell['batch']} {method.name} {cm.describe(knobs)} s{seed}",
        }

    def curves(self, tasks: list[dict]) -> list[dict]:
        return [self.done[t["key"]] for t in tasks]

    def run_all(self, tasks: list[dict]) -> None:
        todo = list({t["key"]: t for t in tasks if t["key"] not in self.done}.values())
        if self.args.cached_only:  # report what is finished; the caller leaves out what is not
            return
        # seed by seed (every method's seed k before any seed k + 1), so a benchmark stopped early has the
        # same paired seeds of every method in every cell (--cached-only --seeds k reports them); within a
        # seed longest first, so the pool stays busy to the end (scratch steps cost ~30 LiT steps)
        todo.sort(
            key=lambda t: (
                t["seed"],
                -t["steps"] * (t["batch"] ** 0.5) * (30 if t["mode"] == "scratch" else 1),
            )
        )
        if not todo:
            return
        labels = {t["key"]: t["label"] for t in todo}
        if self.args.workers <= 1:
            if _BENCH is None or (self.scratch and "scratch" not in _BENCH.tensors):
                _init_worker(self.args, self.scratch)
            self._collect(map(_run_task, todo), labels)
            return
        if self.pool is None:  # one pool for every round: each worker builds its data and models once
            ctx = multiprocessing.get_context("spawn")
            self.pool = ctx.Pool(
                self.args.workers, initializer=_init_worker, initargs=(self.args, self.scratch)
            )
        self._collect(self.pool.imap_unordered(_run_task, todo), labels)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool.join()
            self.pool = None

    def _collect(self, results, labels: dict[str, str]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as fh:
            for i, (key, curve) in enumerate(results, 1):
                self.done[key] = curve
                fh.write(json.dumps({"key": key, "curve": curve}) + "\n")
                fh.flush()
                print(
                    f"[{i}/{len(labels)}] {labels[key]}: val {100 * cr.mean_r1(curve['val'][-1]):.2f} "
                    "held-out "
                    f"{100 * cr.mean_r1(curve['heldout'][-1]):.2f} ({curve['wall_s']:.0f} s; "
                    f"{time.monotonic() - self.started:.0f} s in all)",
                    flush=True,
                )
