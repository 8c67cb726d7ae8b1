"""One from-scratch training run through ``toolkit train``, and the pool that runs many with a run cache.

A run is the real command: ``python -m toolkit train -c CONFIG.yaml`` in its own process with one torch
thread (``OMP_NUM_THREADS=1``), training ``--model`` from random init (``seed``) on the glyph set's training
shards, with the trainer's own zero-shot evaluation (``eval.every_steps``: clip-benchmark's retrieval metrics,
as ``toolkit eval zeroshot`` computes them) on ``val``, ``held`` and ``held_distinct`` at ``--eval-points``
steps. Its curve comes from the run's ``metrics.jsonl``; the median rank of the final model on the held-out
sets is computed here from the saved model (clip-benchmark has no median rank).

A curve: ``{"step", "samples_seen", "train_s" (training seconds up to each evaluation: the logged step times,
evaluation excluded), "val", "heldout", "heldout_distinct" ([i2t, t2i] R@1 per point), "heldout_r10",
"heldout_distinct_r10" (final [i2t, t2i] R@10), "median_rank" {set: [i2t, t2i]}, "tau", "wall_s"}``.
Each finished run is appended to ``CACHE/runs.jsonl`` keyed by everything that defines it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import yaml

from benchmarks.objectives.scratch.glyphset import GlyphSet
from toolkit.train.losses.choice import default_loss

RUN_CACHE_VERSION = 1  # bump when the run procedure changes (invalidates CACHE/runs.jsonl)
WARMUP_FRACTION = 0.1
SETS = {"val": "val", "held": "heldout", "held_distinct": "heldout_distinct"}


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the runs and their cache that ``Runner`` reads (every script of the package)."""
    p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW lr (wd 0.1, 10%% warmup, cosine)")
    p.add_argument("--eval-points", type=int, default=6, help="evaluations per run (the curves' resolution)")
    p.add_argument("--workers", type=int, default=2, help="runs at a time (one torch thread each)")
    p.add_argument("--run-timeout-s", type=float, default=3 * 3600)
    p.add_argument("--fresh", action="store_true", help="ignore finished runs in CACHE/runs.jsonl")
    p.add_argument("--cached-only", action="store_true", help="train nothing: report finished runs only")


def nested(fields: dict[str, Any]) -> dict[str, Any]:
    """{'fastclip.version': 'v3'} -> {'fastclip': {'version': 'v3'}} (the config's sectioned layout)."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        *parents, last = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def train_config(args: argparse.Namespace, data: GlyphSet, task: dict, out: Path) -> dict[str, Any]:
    """The YAML of one run; ``task['fields'] is None``: no loss section (the trainer's default objective)."""
    steps = task["steps"]
    cfg = {
        "data": str(data.train),
        "out": str(out),
        "model": args.model,
        "batch_size": task["batch"],
        "steps": steps,
        "seed": task["seed"],
        "device": "cpu",
        "optim": {"lr": args.lr, "weight_decay": 0.1, "warmup_steps": int(steps * WARMUP_FRACTION)},
        "loader": {"num_workers": 0},
        "log_every": max(1, steps // 50),
        "tensorboard": False,
        "checkpoint": {"every_steps": 0, "keep": 1, "resume": "none"},
        "max_nonfinite_steps": steps + 1,
        "eval": {
            "every_steps": max(1, steps // args.eval_points),
            "root": str(data.evalsets),
            "datasets": list(SETS),
            "batch_size": 512,
        },
    }
    cfg.update(task.get("train") or {})  # top-level TrainConfig keys (patch_dropout, stages, stage_lr)
    if task["fields"] is not None:
        cfg["loss"] = nested(task["fields"])
    else:  # the default objective, as a user gets it: planned by epochs, so the rule sees the run's epochs
        del cfg["steps"]
        cfg["epochs"] = task["epochs"]
    return cfg


def _pair(row: dict, name: str, k: int) -> list[float]:
    return [row[f"eval/{name}/image_retrieval_recall@{k}"], row[f"eval/{name}/text_retrieval_recall@{k}"]]


def parse_metrics(path: Path) -> dict[str, Any]:
    """The curve of a finished run from its metrics.jsonl (see the module doc)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [r for r in rows if "step_time_s" in r]
    evals = [r for r in rows if "eval/held/image_retrieval_recall@1" in r]
    if not evals:
        raise RuntimeError(f"{path}: no evaluation rows")
    cum, last_step, elapsed = [], 0, 0.0
    for r in train:  # step_time_s: the mean step time over the steps since the previous log row
        elapsed += (r["step"] - last_step) * r["step_time_s"]
        last_step = r["step"]
        cum.append((r["step"], elapsed))

    def train_s(step: int) -> float:
        before = [c for c in cum if c[0] <= step]
        base_step, base_s = before[-1] if before else (0, 0.0)
        after = next((c for c in cum if c[0] > step), None)
        if after is None or step == base_step:
            return base_s
        return base_s + (step - base_step) * (after[1] - base_s) / (after[0] - base_step)

    curve: dict[str, Any] = {
        "step": [r["step"] for r in evals],
        "samples_seen": [r["samples_seen"] for r in evals],
        "train_s": [round(train_s(r["step"]), 2) for r in evals],
    }
    for name, key in SETS.items():
        curve[key] = [_pair(r, name, 1) for r in evals]
    curve["heldout_r10"] = _pair(evals[-1], "held", 10)
    curve["heldout_distinct_r10"] = _pair(evals[-1], "held_distinct", 10)
    curve["tau"] = train[-1].get("tau") if train else None
    return curve


def median_ranks(model_dir: Path, csv_path: Path) -> list[float]:
    """[image→text, text→image] median rank (1 = first) of the true pair over one retrieval CSV."""
    import csv

    import torch
    from PIL import Image

    from toolkit.models import load_model

    loaded = load_model(str(model_dir))
    with csv_path.open(newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    with torch.no_grad():
        images = torch.stack([loaded.preprocess(Image.open(r["path"]).convert("RGB")) for r in rows])
        x = torch.nn.functional.normalize(loaded.model.encode_image(images), dim=-1)
        y = torch.nn.functional.normalize(
            loaded.model.encode_text(loaded.tokenizer([r["caption"] for r in rows])), dim=-1
        )
    sim = x @ y.T  # [N images, N captions], pair i on the diagonal
    truth = sim.diagonal()
    i2t = (sim > truth[:, None]).sum(1) + 1
    t2i = (sim > truth[None, :]).sum(0) + 1
    return [float(i2t.float().median()), float(t2i.float().median())]


_LIVE: set[subprocess.Popen] = set()  # the runs' `toolkit train` processes now running (worker threads')
_LIVE_LOCK = threading.Lock()
_STOPPING = threading.Event()  # set by stop_runs: a worker thread between two runs starts no more


def _train(cmd: list[str], log, env: dict, args: argparse.Namespace) -> int:
    """Run ``cmd`` to its end (``--run-timeout-s``: killed, TimeoutExpired) as a child that ``stop_runs``
    can reach; called by the pool's worker threads."""
    with _LIVE_LOCK:
        if _STOPPING.is_set():
            raise RuntimeError("the benchmark is stopping: run not started")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        _LIVE.add(proc)
    try:
        return proc.wait(timeout=args.run_timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    finally:
        with _LIVE_LOCK:
            _LIVE.discard(proc)


def stop_runs(grace_s: float = 60.0) -> None:
    """SIGTERM every running ``toolkit train`` (each checkpoints after its step and exits: a later
    benchmark resumes it), SIGKILL what is left after ``grace_s``. Called by the main thread when the
    benchmark stops early (a signal, Ctrl-C, an error), so that no run outlives it."""
    with _LIVE_LOCK:
        _STOPPING.set()
        procs = list(_LIVE)
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds the main thread through run_all's stop_runs


def _run_one(args: argparse.Namespace, data: GlyphSet, task: dict) -> dict[str, Any]:
    out = Path(args.cache) / "runs" / task["key"]
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.in.yaml"
    cfg_path.write_text(yaml.safe_dump(train_config(args, data, task, out / "run"), sort_keys=False))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p),
    }
    start = time.monotonic()
    with (out / "train.log").open("w") as log:
        returncode = _train([sys.executable, "-m", "toolkit", "train", "-c", str(cfg_path)], log, env, args)
    if returncode != 0:
        tail = (out / "train.log").read_text()[-2000:]
        raise RuntimeError(f"{task['label']}: toolkit train exited {returncode}:\n{tail}")
    curve = parse_metrics(out / "run" / "metrics.jsonl")
    curve["wall_s"] = round(time.monotonic() - start, 1)
    curve["median_rank"] = {
        key: median_ranks(out / "run" / "model", data.root / f"{name}.csv")
        for name, key in SETS.items()
        if name != "val"
    }
    return curve


class Runner:
    """Runs tasks on ``--workers`` processes at a time; each finished run goes to CACHE/runs.jsonl at once
    and ``on_done`` is called (the benchmark rewrites its JSON there)."""

    def __init__(self, args: argparse.Namespace, data: GlyphSet, on_done=None):
        self.args, self.data, self.on_done = args, data, on_done
        self.path = Path(args.cache) / "runs.jsonl"
        self.common = {
            "version": RUN_CACHE_VERSION,
            "data": data.signature,
            "lr": args.lr,
            "model": args.model,
            "eval_points": args.eval_points,
            "warmup_fraction": WARMUP_FRACTION,
        }
        self.done: dict[str, dict] = {}
        self.failed: dict[str, str] = {}
        # key -> label of every task passed to run_all (how a benchmark asks for runs): for its runs file
        self.used: dict[str, str] = {}
        self.lock = threading.Lock()
        if self.path.is_file() and not args.fresh:
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a kill
                    continue
                self.done[rec["key"]] = rec["curve"]
        self.started = time.monotonic()

    def task(self, cell: dict, method, knobs: dict, seed: int, train: dict | None = None) -> dict:
        """The run of ``method`` (None fields: the trainer's default objective) with ``knobs`` in ``cell``;
        ``train``: top-level TrainConfig keys besides the loss (``{"patch_dropout": 0.5}``), in the key only
        when given (so the runs without any keep their keys)."""
        fields = None if not method.fields else {**method.fields, **knobs}
        if fields is not None and str(fields.get("kind")) == "fastclip" and cell["epochs"] > 1:
            over_run = getattr(method, "gamma_over_all_epochs", False)
            decay = max(1, round(cell["epochs"])) if over_run else cell["gamma_decay_epochs"]
            fields.setdefault("fastclip.gamma_decay_epochs", decay)
        ident = {
            **self.common,
            "fields": fields,
            "batch": cell["batch"],
            "steps": cell["steps"],
            "epochs": cell["epochs"],
            "seed": seed,
            **({"train": train} if train else {}),
        }
        if fields is None:  # keyed by what the default resolves to, so a changed default is trained again
            ident["default"] = default_loss(int(cell["epochs"]))
        key = hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
        knob_text = ", ".join(
            f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in {**knobs, **(train or {})}.items()
        )
        return {
            "key": key,
            "method": method.name,
            "fields": fields,
            "batch": cell["batch"],
            "steps": cell["steps"],
            "epochs": cell["epochs"],
            "seed": seed,
            "train": dict(train or {}),
            "label": f"{cell['regime']} b{cell['batch']} {method.name} {knob_text} s{seed}".replace(
                "  ", " "
            ),
        }

    def curves(self, tasks: list[dict]) -> list[dict] | None:
        """The finished curves of ``tasks`` in order, or None when one is missing."""
        if any(t["key"] not in self.done for t in tasks):
            return None
        return [self.done[t["key"]] for t in tasks]

    def run_all(self, tasks: list[dict], retrain: bool = False) -> None:
        """Train the tasks not yet finished (``retrain``: cached ones too, replacing their curves)."""
        self.used.update((t["key"], t["label"]) for t in tasks)
        todo = list(
            {
                t["key"]: t
                for t in tasks
                if (retrain or t["key"] not in self.done) and t["key"] not in self.failed
            }.values()
        )
        if self.args.cached_only or not todo:
            return
        _STOPPING.clear()
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main else None
        try:
            with ThreadPoolExecutor(self.args.workers) as pool:
                futures = {pool.submit(_run_one, self.args, self.data, t): t for t in todo}
                try:
                    self._collect(futures, len(todo))
                except BaseException:
                    for fut in futures:
                        fut.cancel()
                    stop_runs()
                    raise
        finally:
            if main and previous is not None:  # the caller's own handler again (a test process, a notebook)
                signal.signal(signal.SIGTERM, previous)

    def _collect(self, futures: dict, num_todo: int) -> None:
        """Record each run as it finishes (main thread): CACHE/runs.jsonl, the log line, ``on_done``."""
        for i, fut in enumerate(as_completed(futures), 1):
            t = futures[fut]
            try:
                curve = fut.result()
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                self.failed[t["key"]] = str(err)[:500]
                print(f"[{i}/{num_todo}] FAILED {t['label']}: {str(err)[:300]}", flush=True)
                continue
            with self.lock:
                self.done[t["key"]] = curve
                with self.path.open("a") as fh:
                    fh.write(json.dumps({"key": t["key"], "label": t["label"], "curve": curve}) + "\n")
            print(
                f"[{i}/{num_todo}] {t['label']}: val {50 * sum(curve['val'][-1]):.2f} held-out "
                f"{50 * sum(curve['heldout'][-1]):.2f} R@1 ({curve['wall_s']:.0f} s; "
                f"{time.monotonic() - self.started:.0f} s in all)",
                flush=True,
            )
            if self.on_done is not None:
                self.on_done()
