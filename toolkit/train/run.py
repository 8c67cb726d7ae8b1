"""The ``train`` stage: ``run(cfg, eval_fn=None, entry=...) -> StageResult``, and ``worker_main`` for ranks.

Three ways in, one loop (``loop.train``):
- one process (the default): trains here;
- ``launch.nproc_per_node > 1`` / several nodes / restarts: this process becomes torchrun's elastic
  agent and starts the ranks, each running ``python -m ENTRY CONFIG.yaml`` (``entry`` is a module whose
  ``main`` calls ``worker_main``; the CLI and the pipeline pass one that builds their evaluation
  callback, since ``train`` never imports ``eval``);
- already a rank (started by the user's torchrun, or ``srun`` with SLURM's variables): trains as that
  rank; rank 0 keeps the stage books.
Stage books (``config.yaml``, ``manifest.json``, ``log.jsonl`` in OUT) are kept by the launching process
(node 0's) or by rank 0, never by both.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from toolkit.core import files
from toolkit.core.config import ConfigError, build, read_yaml
from toolkit.core.log import get_logger
from toolkit.core.stage import StageInterrupted, StageResult, stage_run
from toolkit.train import launch as L
from toolkit.train.config import TrainConfig
from toolkit.train.loop import EvalFn

KIND = "train"
SUMMARY = ".train-summary.json"
DEFAULT_ENTRY = "toolkit.train.worker"


class Preempted(StageInterrupted):
    """Training stopped on a signal after writing a checkpoint; rerunning the command continues it."""


def _record(rec, summary: dict) -> None:
    out = rec.out
    rec.counts.update({k: summary[k] for k in ("step", "total_steps", "samples_seen", "skipped_steps",
                                               "world_size") if k in summary})
    rec.details.update(summary)
    rec.outputs.update(run_dir=out, metrics=files.join(out, "metrics.jsonl"),
                       checkpoints=files.join(out, "checkpoints"))
    if summary.get("model"):
        rec.outputs["model"] = summary["model"]
    if summary.get("preempted"):
        raise Preempted(f"preempted at step {summary['step']} of {summary['total_steps']}; a checkpoint was "
                           "written: rerun the same command to continue (resume: auto)")


def preflight(cfg: TrainConfig) -> None:
    """Refuse what would fail on every rank, before any process starts or any output is written: data that
    does not fit the model, a global batch larger than the data or not divisible by the ranks, a checkpoint
    to resume that was written with another configuration (``resume.ConfigMismatch``)."""
    from toolkit.data.trainset.format import TrainDataset
    from toolkit.data.trainset.order import BatchOrder
    from toolkit.models.factory import resolve_spec
    from toolkit.train.model import check_dataset
    from toolkit.train.resume import refuse_other_config

    if not files.is_local(cfg.out):
        raise ConfigError("train", "out", f"the run directory must be local for now, got {cfg.out}")
    dataset = TrainDataset.open(cfg.data)
    order = BatchOrder(dataset.num_samples, cfg.batch_size, cfg.seed, cfg.loader.shuffle_block)
    lo, hi = cfg.launch.node_range()
    if lo == hi:  # an elastic job's world size is known only at rendezvous (each rank checks it then)
        order.batch_ids(0, 0, lo * cfg.launch.nproc_per_node)
    if not (dataset.field("image_features") or dataset.field("text_features")):
        check_dataset(resolve_spec(cfg.model).model_cfg, dataset, cfg.model)
    refuse_other_config(cfg)
    L.warn_unused_port(cfg.launch)


def run(cfg: TrainConfig, eval_fn: EvalFn | None = None, entry: str = DEFAULT_ENTRY) -> StageResult:
    """Train per ``cfg`` (module docstring). Raises on failure; preemption raises after checkpointing."""
    L.apply_slurm_env(cfg.launch)
    if L.is_worker():
        return _as_rank(cfg, eval_fn)
    preflight(cfg)
    if cfg.launch.is_multiprocess:
        keeps_books = cfg.launch.node_rank == 0
        with stage_run(KIND, cfg, cfg.out) if keeps_books else _Nothing(cfg.out) as rec:
            summary_path = Path(cfg.out) / SUMMARY
            summary_path.unlink(missing_ok=True)
            L.launch(cfg, entry)
            if summary_path.is_file():
                _record(rec, json.loads(summary_path.read_text()))
        return rec.result()
    from toolkit.train.loop import train

    with stage_run(KIND, cfg, cfg.out) as rec:
        _record(rec, train(cfg, eval_fn))
    return rec.result()


def _as_rank(cfg: TrainConfig, eval_fn: EvalFn | None) -> StageResult:
    """This process is one rank of a job; rank 0 keeps the books unless a cliptk launcher does."""
    from toolkit.train.loop import train

    rank = int(os.environ["RANK"])
    if rank == 0 and not L.launched_by_cliptk():
        with stage_run(KIND, cfg, cfg.out) as rec:
            _record(rec, train(cfg, eval_fn))
        return rec.result()
    summary = train(cfg, eval_fn)
    if rank == 0:
        files.write_json_atomic(files.join(cfg.out, SUMMARY), summary)
    rec = _Nothing(cfg.out)
    rec.details.update(summary)
    return rec.result()


class _Nothing:
    """A stand-in recorder for processes that do not keep the stage books."""

    def __init__(self, out: str):
        self.out, self.outputs, self.counts, self.details = out, {}, {}, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def result(self) -> StageResult:
        return StageResult(self.out, dict(self.outputs), dict(self.counts), "", dict(self.details))


def worker_main(make_eval_fn: Callable[[TrainConfig], EvalFn | None] | None = None,
                argv: list[str] | None = None) -> None:
    """A launched rank: ``python -m ENTRY CONFIG.yaml``; ``make_eval_fn(cfg)`` builds the evaluation
    callback (the entry module's). Exits 0 when preempted after a checkpoint, 1 with a one-line error."""
    argv = sys.argv[1:] if argv is None else argv
    from toolkit.core.log import setup_logging

    rank0 = os.environ.get("RANK", "0") == "0"  # the other ranks report warnings and errors only
    setup_logging(os.environ.get("CLIPTK_LOG_LEVEL", "INFO") if rank0 else "WARNING")
    path = argv[0]
    try:
        cfg = build(TrainConfig, read_yaml(path), source=path)
        run(cfg, make_eval_fn(cfg) if make_eval_fn else None)
    except Preempted:
        return
    except Exception as err:  # one line per rank; torchrun reports the exit code
        get_logger("train").error("rank %s: %s: %s", os.environ.get("RANK", "?"), type(err).__name__, err)
        raise SystemExit(1) from err
