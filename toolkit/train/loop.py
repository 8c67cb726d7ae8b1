"""The training loop, run by every rank: ``train(cfg, eval_fn) -> summary``.

Read ``train`` top to bottom: build the parts (``Runtime``: process group and device; ``TrainData``;
the model, DDP-wrapped; the objective; ``Update``: optimiser, schedules, AMP, clip; ``StateIO``:
checkpoints and resume; ``Reporter``: metrics, plots, final model), resume, then for every global batch
t: ``update.begin`` (lr, τ, γ) -> this rank's slice to the device -> forward/loss/backward
(``step.forward_backward``, gradient cache included) -> ``update.finish`` (unscale, clip, finite?
step : skip) -> report, checkpoint, evaluation, preemption check. ``TrainState`` holds the few counters
a checkpoint must carry; everything else (lr, γ, the random streams, the data position) follows from
the step number, so a resume at any world size continues exactly.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from toolkit.core import dist as D
from toolkit.core.log import get_logger
from toolkit.core.seeds import stream_seed
from toolkit.core.watchdog import Heartbeat
from toolkit.data.trainset.format import TrainDataset
from toolkit.train import ema as ema_lib
from toolkit.train import model as model_lib
from toolkit.train import stages as stages_lib
from toolkit.train import towers
from toolkit.train.batches import TrainData, open_data, step_counts
from toolkit.train.checkpoint.state import StateIO, nonfinite_note, sync_buffers
from toolkit.train.config import TrainConfig
from toolkit.train.ddp import wrap_ddp
from toolkit.train.launch.signals import PreemptionFlag
from toolkit.train.losses import build_loss
from toolkit.train.losses.base import TrainingLoss
from toolkit.train.report import Reporter
from toolkit.train.runtime import Runtime
from toolkit.train.step import StepInputs, forward_backward
from toolkit.train.trainstate import TrainState
from toolkit.train.update import Update

# eval_fn(clip, model_cfg, preprocess_cfg, step) -> {"eval/<dataset>/<metric>": value}: rank 0 only, on the
# live model in eval mode; passed in by the CLI/pipeline (train never imports eval).
EvalFn = Callable[[Any, dict, dict, int], dict[str, float]]


class TrainingAborted(RuntimeError):
    """Too many non-finite steps in a row; the message names the step and the last lr and τ."""


@dataclass
class Parts:
    """Every rank's parts of one run (``build_parts``); each owns its own state."""

    cfg: TrainConfig
    rt: Runtime
    data: TrainData
    built: model_lib.BuiltModel
    model: nn.Module  # the TrainModel, DDP-wrapped when the group has several ranks
    loss_fn: TrainingLoss
    update: Update
    io: StateIO
    micro_batch_size: int
    ema: ema_lib.EMA | None = None  # --ema-decay: the averaged weights (train/ema.py)
    stages: stages_lib.StagePlan | None = (
        None  # --stages: resolution and text-length stages (train/stages.py)
    )
    sharded: Any = None  # --fsdp: train/fsdp.Sharded (the model is FSDP2-sharded instead of DDP-wrapped)


def build_parts(cfg: TrainConfig, dataset: TrainDataset | None = None) -> Parts:
    """Build every rank's parts (collective: process group, DDP, FastCLIP's shared tables). ``dataset``:
    the training set this process's preflight opened and checked (``open_data``); None: opened here."""
    rt = Runtime.start(cfg.launch, cfg.device, cfg.release_freed_memory)
    plan = cfg.data_plan()
    dataset = dataset if dataset is not None else open_data(plan, cfg.loss, rt.world_size)
    steps = step_counts(plan, dataset.num_samples)
    built = model_lib.build(
        cfg.model,
        cfg.init,
        dataset,
        cfg.loss.initial_tau,
        cfg.loss.learns_logit_scale,
        cfg.seed,
        logit_bias=cfg.loss.init_logit_bias,
    )
    built.model.to(rt.device).train()
    stage_plan = stages_lib.build(cfg, built.model, built.model_cfg, steps.total)  # before compile and DDP
    towers.prepare(built.model, cfg)  # locks, checkpointing, compile: before the optimiser and DDP see it
    cuda, sharded = rt.device.type == "cuda", None
    if cfg.fsdp:
        from toolkit.train import fsdp

        sharded = fsdp.shard(
            built.model, cfg.precision, cfg.fsdp_cpu_offload, rt.device, cfg.fsdp_reshard_after_forward
        )
        model = built.model
    else:
        model = wrap_ddp(
            built.model, grad_dtype=cfg.grad_dtype, device_ids=[rt.device.index] if cuda else None
        )
    loss_fn = build_loss(cfg.loss, data_size=dataset.num_samples, check_sizes=False)
    update = Update(built.model.clip, loss_fn, cfg.optim, cfg.loss, steps.total, cfg.precision)
    if sharded is not None:
        update.clip_grad_norm = sharded.clip_grad_norm
    micro = cfg.micro_batch_size
    if micro == "auto":
        from toolkit.train.plan import automicro

        micro = automicro.choose(cfg, built.model, rt, dataset.num_samples)
    data = TrainData(plan, rt, dataset, micro)
    io = StateIO(cfg, rt, steps, built, update, loss_fn)
    # the average starts at the initial weights; resume loads its own
    io.ema = (
        ema_lib.build(built.model.clip, cfg.ema_decay)
        if sharded is None
        else fsdp.build_ema(built, cfg.ema_decay)
    )
    io.sharded = sharded
    D.LEDGER.reset()
    return Parts(cfg, rt, data, built, model, loss_fn, update, io, micro, io.ema, stage_plan, sharded)


def train(
    cfg: TrainConfig,
    eval_fn: EvalFn | None = None,
    dataset: TrainDataset | None = None,
    skip_config_check: str = "",
) -> dict[str, Any]:
    """Train on every rank (module docstring); rank 0 writes metrics, checkpoints and RUN_DIR/model. The
    signal handlers go in first: a SIGTERM while the parts are built stops the run after its first step
    (with a checkpoint) instead of killing the process with the manifest left "running"."""
    flag = PreemptionFlag.install()
    beat = Heartbeat.start(cfg.out, int(os.environ.get("RANK", "0")))  # the launcher's watchdog reads it
    try:
        return _train(cfg, eval_fn, dataset, skip_config_check, flag, beat)
    finally:
        flag.uninstall()
        if beat is not None:
            beat.stop()


def _train(
    cfg: TrainConfig,
    eval_fn: EvalFn | None,
    dataset: TrainDataset | None,
    skip_config_check: str,
    flag: PreemptionFlag,
    beat: Heartbeat | None = None,
) -> dict[str, Any]:
    p = build_parts(cfg, dataset)
    state = p.io.resume(skip_config_check=skip_config_check)
    resumed = state.step if state.step or p.io.last_step is not None else None
    report = Reporter(cfg.report_plan(), p.rt, p.data.steps, resumed, asdict(cfg))
    try:
        for batch in report.timed(p.data.batches(state.step)):
            outcome, lr = train_step(p, state, batch)
            if beat is not None:
                beat.reached(state.step)
            p.io.check_writes()  # a failed background checkpoint write stops training here, naming it
            report.step_done(state, batch, outcome, lr, p.update)
            if (
                cfg.eval.every_steps
                and state.step % cfg.eval.every_steps == 0
                and state.step < p.data.total_steps
            ):
                report.log(state, evaluate(p, eval_fn, state.step), quiet=True)
            if cfg.checkpoint.every_steps and state.step % cfg.checkpoint.every_steps == 0:
                save_checkpoint(p, report, state)
            # after the last step the run finishes normally (model written) whatever the signal
            if state.step < p.data.total_steps and flag.agreed(p.rt.world_size):
                p.io.save(state)  # finish writes the plots, once
                return finish(p, report, state, preempted=True)
        if cfg.eval.every_steps:
            report.log(state, evaluate(p, eval_fn, state.step), quiet=True)
        p.io.save(state)
        return finish(p, report, state, preempted=False)
    except BaseException:
        with contextlib.suppress(Exception):  # the error in flight stays the one reported
            p.io.close()  # a checkpoint being written when training stops is completed first
        raise
    finally:
        report.close()
        if p.sharded is not None:
            p.sharded.close()


def train_step(p: Parts, state: TrainState, batch: dict):
    """One global batch: schedules, forward/backward, then the update or a skip. Returns (Outcome, lr)."""
    cfg, t = p.cfg, state.step
    if int(batch["step"]) != t:
        raise RuntimeError(f"data loader out of order: expected global batch {t}, got {int(batch['step'])}")
    lr = p.update.begin(t, p.data.steps_per_epoch)
    trim = p.built.model.trim_tokens
    if p.stages is not None:
        lr = p.stages.begin(t, p.built.model, p.update, lr)
        trim = p.stages.tokens_fn(t, p.built.model, batch["index"])
    reference = p.data.reference_to_device(batch) if p.loss_fn.reads_reference else None
    inputs = StepInputs(
        *p.data.to_device(batch, trim),
        reference=reference,
        patch_seed=stream_seed(cfg.seed, t, 0, 0) if cfg.patch_dropout else None,
    )
    forward_backward(
        p.model,
        p.loss_fn,
        inputs,
        micro_batch_size=p.micro_batch_size,
        seed_of=lambda i: stream_seed(cfg.seed, t, p.rt.rank, i),
        autocast=p.rt.autocast(cfg.precision),
        scale=p.update.scale,
        poison=t in cfg.nonfinite_test_steps,
        offload_features=p.data.offloaded,
    )
    if p.sharded is not None:
        p.sharded.finish_backward()  # the replicated scalars' gradients averaged
    outcome = p.update.finish(p.loss_fn.global_value())  # global_value: collective, equal on every rank
    state.step += 1
    state.samples_seen += cfg.batch_size
    if outcome.applied:
        state.nonfinite_in_row = 0
        if p.ema is not None:
            p.ema.update(p.built.model.clip)
        return outcome, lr
    state.skipped_steps += 1
    state.nonfinite_in_row += 1
    get_logger("train").warning(
        "step %d: non-finite %s; step skipped (no optimiser or table update)", t + 1, outcome.what_failed()
    )
    if state.nonfinite_in_row >= cfg.max_nonfinite_steps:
        raise TrainingAborted(
            f"{state.nonfinite_in_row} steps in a row with a non-finite loss or gradient, "
            f"the last at step {t + 1} (lr {lr:.3g}, tau {p.update.temperature():.4g}); lower "
            "the lr or check the data" + nonfinite_note(p.io, t + 2 - state.nonfinite_in_row)
        )
    return outcome, lr


def evaluate(p: Parts, eval_fn: EvalFn | None, step: int) -> dict[str, float]:
    """Zero-shot evaluation on rank 0 through the callback (other ranks wait); {} without a callback."""
    sync_buffers(p.built.model.clip, p.rt.world_size)
    out: dict[str, float] = {}
    built, ema = p.built, p.ema
    if p.sharded is not None and eval_fn is not None:  # rank 0 evaluates whole models: gathered (collective)
        built, ema = p.sharded.gathered(p.built, p.ema)
    if p.rt.rank == 0 and eval_fn is not None:
        clip = built.model.clip
        clip.eval()
        try:
            with torch.no_grad():
                out = eval_fn(clip, p.built.model_cfg, p.built.preprocess_cfg, step)
                if ema is not None:  # the averaged weights beside the raw ones
                    ema_out = eval_fn(ema.model, p.built.model_cfg, p.built.preprocess_cfg, step)
                    out.update(ema_lib.prefixed(ema_out))
        finally:
            clip.train()
    D.barrier()
    return out


def save_checkpoint(p: Parts, report: Reporter, state: TrainState) -> None:
    """Checkpoint ``state.step`` (all ranks call; rank 0 writes) unless it exists, then rank 0's plots."""
    if p.io.save(state):
        report.plots()


def finish(p: Parts, report: Reporter, state: TrainState, preempted: bool) -> dict[str, Any]:
    """Rank 0 writes OUT/model (unless preempted) and the plots (once: matplotlib's import and two
    figures are ~1.4 s, 2% of a 40-step benchmark run); every rank returns the same summary."""
    p.io.close()
    built, ema = p.built, p.ema
    if p.sharded is not None and not preempted:  # rank 0 writes whole models: gathered (collective)
        built, ema = p.sharded.gathered(p.built, p.ema)
    model_dir = None if preempted else report.final_model(built)
    if ema is not None and not preempted and p.rt.rank == 0:
        ema.save_model(p.cfg.out, p.built.model_cfg, p.built.preprocess_cfg)
    report.plots()
    D.barrier()
    return {
        "step": state.step,
        "total_steps": p.data.total_steps,
        "samples_seen": state.samples_seen,
        "skipped_steps": state.skipped_steps,
        "preempted": preempted,
        "world_size": p.rt.world_size,
        "model": model_dir,
        "steps_per_epoch": p.data.steps_per_epoch,
    }
