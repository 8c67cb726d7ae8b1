"""The ``train`` stage: ``run(cfg, eval_fn=None, eval_factory="") -> StageResult``, and ``worker_main`` for
ranks.

Three ways in, one loop (``loop.train``):
- one process (the default): trains here;
- ``launch.nproc_per_node > 1`` / several nodes / restarts: this process becomes torchrun's elastic
  agent and starts the ranks, each running the trainer's entry ``python -m toolkit.train.worker
  CONFIG.yaml [--eval-factory MODULE:FUNCTION]``; ``eval_factory`` names the function that builds the
  evaluation callback from the config in each rank (``train`` never imports ``eval``: the glue above
  both, ``toolkit.trainval``, passes its own);
- already a rank (started by the user's torchrun, or ``srun`` with SLURM's variables): trains as that
  rank; rank 0 keeps the stage books.
Stage books (``config.yaml``, ``manifest.json``, ``log.jsonl`` in OUT) are kept by the launching process
(node 0's) or by rank 0, never by both.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from toolkit.core import files
from toolkit.core.config import ConfigError, build
from toolkit.core.config_load import read_yaml
from toolkit.core.launch import apply_slurm_env, is_worker, launch_job, launched_by_cliptk, warn_unused_port
from toolkit.core.log import get_logger
from toolkit.core.stage import StageResult, stage_run
from toolkit.train.config import CheckpointConfig, EvalConfig, TrainConfig
from toolkit.train.loop import EvalFn

KIND = "train"
ENTRY = "toolkit.train.worker"  # the module every launched rank runs
EVAL_FACTORY_FLAG = "--eval-factory"
# Why a rank may skip the refusal of a checkpoint of another configuration (it reads the newest
# checkpoint's trainer.json on every rank): the check ran once already. The fit checks always run.
PREFLIGHT_CHECKED = "this process's preflight refused a checkpoint of another configuration"
LAUNCHER_CHECKED = "cliptk's launcher refused a checkpoint of another configuration before starting the ranks"
PREEMPTED = "preempted"  # the manifest status of a run stopped by a signal after its checkpoint


def _record(rec, summary: dict) -> None:
    """Put the loop's summary into the stage books; a preempted run is recorded as such (not failed)."""
    out = rec.out
    rec.counts.update(
        {
            k: summary[k]
            for k in ("step", "total_steps", "samples_seen", "skipped_steps", "world_size")
            if summary.get(k) is not None
        }
    )
    rec.details.update(summary)
    rec.outputs.update(
        run_dir=out, metrics=files.join(out, "metrics.jsonl"), checkpoints=files.join(out, "checkpoints")
    )
    if summary.get("model"):
        rec.outputs["model"] = summary["model"]
    if summary.get("preempted"):
        rec.status = PREEMPTED


def preempted_message(summary: dict) -> str:
    return (
        f"preempted at step {summary['step']} of {summary['total_steps']}; a checkpoint was written: rerun "
        "the same command to continue (resume: auto)"
    )


def launched_summary(checkpoint: CheckpointConfig, out: str) -> dict[str, Any] | None:
    """The outcome of a job whose ranks ran in other processes, from what they leave anyway: the newest
    checkpoint (every run ends, or stops on a signal, by writing one) and OUT/model. torchrun's launch API
    returns the ranks' return values only for a Python callable started with multiprocessing; cliptk's
    ranks are ``python -m ENTRY`` programs (so the user's own torchrun or srun runs the very same ranks), for
    which it returns nothing. None when no checkpoint exists."""
    from toolkit.train.checkpoint import format as ckpt
    from toolkit.train.checkpoint.resume import checkpoints_dir

    path = ckpt.latest_valid(checkpoints_dir(checkpoint, out))
    if path is None:
        return None
    saved = ckpt.read_trainer_state(path)
    state, total = saved["state"], saved.get("total_steps")
    model = files.join(out, "model")
    # a checkpoint from before cliptk recorded total_steps: finished exactly when the ranks wrote the model
    preempted = state["step"] < total if total is not None else not files.exists(model)
    return {
        **{k: state.get(k) for k in ("step", "samples_seen", "skipped_steps")},
        "total_steps": total,
        "world_size": saved.get("world_size"),
        "steps_per_epoch": saved.get("steps_per_epoch"),
        "preempted": preempted,
        "model": None if preempted or not files.exists(model) else model,
    }


def preflight(cfg: TrainConfig):
    """Refuse what would fail on every rank, before any process starts or any output is written: data that
    does not fit the model, a global batch larger than the data or not divisible by the ranks, a training set
    without the reference embeddings the objective reads (``batches.open_data``), a checkpoint
    to resume that was written with another configuration (``resume.ConfigMismatch``). Returns the opened
    training set (a one-process run trains on it without opening or checking it again)."""
    from toolkit.train.batches import open_data
    from toolkit.train.checkpoint.datacheck import refuse_other_data
    from toolkit.train.checkpoint.resume import refuse_other_config
    from toolkit.train.model import check_fit

    if not files.is_local(cfg.out):
        raise ConfigError("train", "out", f"the run directory must be local for now, got {cfg.out}")
    lo, hi = cfg.launch.node_range()
    # an elastic job's world size is known only at rendezvous (each rank checks it then)
    dataset = open_data(cfg.data_plan(), cfg.loss, lo * cfg.launch.nproc_per_node if lo == hi else None)
    check_fit(cfg.model, dataset)  # frozen-tower features too: against the model with their towers
    refuse_other_config(cfg)
    refuse_other_data(cfg.checkpoint, cfg.out, cfg.data)
    warn_unused_port(cfg.launch)
    return dataset


def run(cfg: TrainConfig, eval_fn: EvalFn | None = None, eval_factory: str = "") -> StageResult:
    """Train per ``cfg`` (module docstring) with ``eval_fn`` in this process and ``eval_factory``
    ("module:function" of ``(cfg.eval) -> EvalFn | None``) building it in launched ranks. Raises on failure; a
    preempted run returns with ``status == "preempted"`` after its checkpoint."""
    apply_slurm_env(cfg.launch)
    if is_worker():
        return _as_rank(cfg, eval_fn)
    dataset = preflight(cfg)
    if cfg.launch.is_multiprocess:
        keeps_books = cfg.launch.node_rank == 0
        with stage_run(KIND, cfg, cfg.out) if keeps_books else _Nothing(cfg.out) as rec:
            launch_job(
                cfg.launch, cfg, ENTRY, "training", (EVAL_FACTORY_FLAG, eval_factory) if eval_factory else ()
            )
            summary = launched_summary(cfg.checkpoint, cfg.out)
            if summary is not None:
                _record(rec, summary)
        return rec.result()
    from toolkit.train.loop import train

    with stage_run(KIND, cfg, cfg.out) as rec:
        _record(rec, train(cfg, eval_fn, dataset=dataset, skip_config_check=PREFLIGHT_CHECKED))
    return rec.result()


def _as_rank(cfg: TrainConfig, eval_fn: EvalFn | None) -> StageResult:
    """This process is one rank of a job; rank 0 keeps the books unless a cliptk launcher does (then the
    launcher has run the preflight checks too)."""
    from toolkit.train.loop import train

    rank = int(os.environ["RANK"])
    by_cliptk = launched_by_cliptk()
    if rank == 0 and not by_cliptk:
        with stage_run(KIND, cfg, cfg.out) as rec:
            _record(rec, train(cfg, eval_fn))
        return rec.result()
    rec = _Nothing(cfg.out)
    _record(rec, train(cfg, eval_fn, skip_config_check=LAUNCHER_CHECKED if by_cliptk else ""))
    return rec.result()


class _Nothing:
    """A stand-in recorder for processes that do not keep the stage books."""

    def __init__(self, out: str):
        self.out, self.outputs, self.counts, self.details, self.status = out, {}, {}, {}, "done"

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def result(self) -> StageResult:
        return StageResult(
            self.out, dict(self.outputs), dict(self.counts), "", dict(self.details), self.status
        )


def worker_main(argv: list[str] | None = None) -> None:
    """A launched rank: ``python -m toolkit.train.worker CONFIG.yaml [--eval-factory MODULE:FUNCTION]``; the
    factory, called with the config's ``eval`` section, builds the evaluation callback. Exits 0 when done or
    preempted after a checkpoint, 1 with a one-line error."""
    argv = sys.argv[1:] if argv is None else argv
    from toolkit.core.log import setup_logging
    from toolkit.core.procs import die_with_parent

    if os.environ.get(
        "CLIPTK_AGENT_PID"
    ):  # started by cliptk's agent: never outlive it (a SIGKILLed launcher)
        die_with_parent(parent_pid=int(os.environ["CLIPTK_AGENT_PID"]))

    rank0 = os.environ.get("RANK", "0") == "0"  # the other ranks report warnings and errors only
    setup_logging(os.environ.get("CLIPTK_LOG_LEVEL", "INFO") if rank0 else "WARNING")
    path, factory = _worker_args(argv)
    try:
        cfg = build(TrainConfig, read_yaml(path), source=path)
        run(cfg, _load_factory(factory)(cfg.eval) if factory else None)
    except Exception as err:  # one line per rank; torchrun reports the exit code
        from toolkit.core.agent import write_error_file

        get_logger("train").error("rank %s: %s: %s", os.environ.get("RANK", "?"), type(err).__name__, err)
        write_error_file(" ".join(f"{type(err).__name__}: {err}".split()))  # the launcher names it
        raise SystemExit(1) from err


def _worker_args(argv: list[str]) -> tuple[str, str]:
    """(CONFIG.yaml, the eval factory or "") of a rank's command line; SystemExit 2 naming the usage."""
    if len(argv) == 1:
        return argv[0], ""
    if len(argv) == 3 and argv[1] == EVAL_FACTORY_FLAG:
        return argv[0], argv[2]
    raise SystemExit(
        f"usage: python -m {ENTRY} CONFIG.yaml [{EVAL_FACTORY_FLAG} MODULE:FUNCTION] (got {argv})"
    )


def _load_factory(name: str) -> Callable[[EvalConfig], EvalFn | None]:
    """The function ``module:function`` names (the caller's evaluation glue, imported by name)."""
    import importlib

    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)
