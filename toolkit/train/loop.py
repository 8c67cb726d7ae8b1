"""The training loop, run by every rank: ``train(cfg, eval_fn) -> summary``.

Read it top to bottom in ``train``: set up (process group, data order, model, objective, optimiser),
resume, then for every global batch t: schedules -> this rank's slice -> forward/loss/backward
(``step.forward_backward``, gradient cache included) -> non-finite check -> clip, optimiser step, τ
clamp -> metrics, checkpoint, evaluation, preemption check. ``state`` holds the few counters a
checkpoint must carry; everything else (lr, γ, the random streams, the data position) follows from the
step number, so a resume at any world size continues exactly.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from toolkit.core import dist as D
from toolkit.core.log import get_logger
from toolkit.train import checkpoint as ckpt
from toolkit.train.config import TrainConfig
from toolkit.train.resume import nonfinite_abort_note
from toolkit.train.setup import Setup, build_setup
from toolkit.train.signals import PreemptionFlag
from toolkit.train.step import StepInputs, forward_backward, stream_seed

# eval_fn(clip, model_cfg, preprocess_cfg, step) -> {"eval/<dataset>/<metric>": value}: rank 0 only, on the
# live model in eval mode; passed in by the CLI/pipeline (train never imports eval).
EvalFn = Callable[[Any, dict, dict, int], dict[str, float]]


class TrainingAborted(RuntimeError):
    """Too many non-finite steps in a row; the message names the step and the last lr and τ."""


@dataclass
class TrainState:
    """What a checkpoint carries besides weights, optimiser and loss state."""

    step: int = 0  # global batches consumed (= the next batch's index t)
    samples_seen: int = 0
    skipped_steps: int = 0
    nonfinite_in_row: int = 0


def train(cfg: TrainConfig, eval_fn: EvalFn | None = None) -> dict[str, Any]:
    """Train on every rank (module docstring); rank 0 writes metrics, checkpoints and RUN_DIR/model."""
    s = build_setup(cfg)
    state = resume(s)
    flag = PreemptionFlag.install()
    try:
        window = Window(time.monotonic())
        for batch in s.batches(state.step):
            window.data_wait_s += time.monotonic() - window.mark
            metrics = train_step(s, state, batch)
            s.checkpoints.check()  # a failed background checkpoint write stops training here, naming it
            window.record(metrics, s)
            if state.step % cfg.log_every == 0 or state.step == s.total_steps:
                s.log_metrics(state, window.flush(s))
            if cfg.eval.every_steps and state.step % cfg.eval.every_steps == 0 and state.step < s.total_steps:
                s.log_metrics(state, evaluate(s, eval_fn, state.step), quiet=True)
            if cfg.checkpoint.every_steps and state.step % cfg.checkpoint.every_steps == 0:
                save_checkpoint(s, state)
            if flag.agreed(s.group_size):
                save_checkpoint(s, state)
                return s.finish(state, preempted=True)
            window.mark = time.monotonic()
        if cfg.eval.every_steps:
            s.log_metrics(state, evaluate(s, eval_fn, state.step), quiet=True)
        save_checkpoint(s, state)
        return s.finish(state, preempted=False)
    finally:
        flag.uninstall()
        s.close()


def train_step(s: Setup, state: TrainState, batch: dict) -> dict[str, float]:
    """One global batch: schedules, forward/backward, then the update or a skip. Returns step metrics."""
    cfg, t = s.cfg, state.step
    if int(batch["step"]) != t:
        raise RuntimeError(f"data loader out of order: expected global batch {t}, got {int(batch['step'])}")
    epoch = t // s.steps_per_epoch
    s.loss_fn.begin_step(t, s.steps_per_epoch)
    lr = s.set_lr(t)
    inputs = StepInputs(*s.to_device(batch))
    share = forward_backward(s.model, s.loss_fn, inputs, micro_batch_size=s.micro_batch_size,
                             seed_of=lambda i: stream_seed(cfg.seed, t, s.rank, i), autocast=s.autocast,
                             scale=s.scale, poison=t in cfg.nonfinite_test_steps, offload_features=s.offloaded)
    value = float(s.loss_fn.global_value())  # collective: identical on every rank
    grad_norm = s.unscale_and_clip()
    finite = math.isfinite(value) and math.isfinite(grad_norm)
    if finite:
        s.optimizer_step()
        state.nonfinite_in_row = 0
    else:
        s.skip_step()
        state.skipped_steps += 1
        state.nonfinite_in_row += 1
        get_logger("train").warning("step %d: non-finite %s; step skipped (no optimiser or table update)",
                                    t + 1, "loss" if not math.isfinite(value) else "gradient")
        if state.nonfinite_in_row >= cfg.max_nonfinite_steps:
            raise TrainingAborted(f"{state.nonfinite_in_row} steps in a row with a non-finite loss or gradient, "
                                  f"the last at step {t + 1} (lr {lr:.3g}, tau {s.tau():.4g}); lower the lr or "
                                  "check the data" + nonfinite_abort_note(s, t + 2 - state.nonfinite_in_row))
    s.zero_grad()
    if s.audit is not None:
        s.audit.record(t + 1, batch["index"].tolist(), skipped=not finite)
    state.step += 1
    state.samples_seen += cfg.batch_size
    del share
    return {"epoch": epoch, "loss": value, "lr": lr, "tau": s.tau(), **s.loss_fn.metrics(),
            "grad_norm": grad_norm if finite else None}


class Window:
    """Throughput and timing between two logged steps."""

    def __init__(self, now: float):
        self.start = self.mark = now
        self.steps, self.data_wait_s, self.last = 0, 0.0, {}

    def record(self, metrics: dict, s: Setup) -> None:
        self.steps += 1
        self.last = metrics

    def flush(self, s: Setup) -> dict[str, Any]:
        now = time.monotonic()
        elapsed = max(now - self.start, 1e-9)
        out = {**self.last, "samples_per_s": self.steps * s.cfg.batch_size / elapsed,
               "step_time_s": elapsed / max(self.steps, 1), "data_wait_s": self.data_wait_s / max(self.steps, 1),
               **s.comm_and_memory(self.steps)}
        self.start, self.steps, self.data_wait_s = now, 0, 0.0
        return out


def evaluate(s: Setup, eval_fn: EvalFn | None, step: int) -> dict[str, float]:
    """Zero-shot evaluation on rank 0 through the callback (other ranks wait); {} without a callback."""
    s.sync_buffers()
    out: dict[str, float] = {}
    if s.rank == 0 and eval_fn is not None:
        clip = s.clip
        clip.eval()
        try:
            with torch.no_grad():
                out = eval_fn(clip, s.built.model_cfg, s.built.preprocess_cfg, step)
        finally:
            clip.train()
    D.barrier()
    return out


def save_checkpoint(s: Setup, state: TrainState) -> None:
    """Checkpoint ``state.step`` (all ranks call; rank 0 writes); skipped when it already exists."""
    s.loss_fn_sync()
    s.sync_buffers()
    if s.rank == 0 and s.last_checkpoint != state.step:
        s.write_checkpoint(asdict(state))
    s.last_checkpoint = state.step
    D.barrier()


def resume(s: Setup) -> TrainState:
    """The state to start from: a verified checkpoint (loaded into model, optimiser and loss) or fresh."""
    path = s.resume_path()
    if path is None:
        return TrainState()
    saved = ckpt.read_trainer_state(path)
    s.load_checkpoint(path, saved)
    fields = TrainState.__dataclass_fields__
    state = TrainState(**{k: v for k, v in saved["state"].items() if k in fields})
    get_logger("train").info("resumed from %s: step %d, %d samples seen", path, state.step, state.samples_seen)
    return state
