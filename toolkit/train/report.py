"""What a run reports: ``Reporter`` — metrics.jsonl (and TensorBoard), progress, the sample audit,
plots, and the final model in OUT/model.

Rank 0 writes metrics, progress, plots and the model; every rank writes its own audit lines
(``audit_samples``). The loop hands it each step's ``Outcome``; numbers become Python floats only at
logged steps (``log_every``), so a step that is not logged costs no host sync here.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from toolkit.core import dist as D
from toolkit.models import weights
from toolkit.train.batches import StepCounts
from toolkit.train.config import ReportPlan
from toolkit.train.metrics import MetricsWriter, Progress, SampleAudit, write_plots
from toolkit.train.model import BuiltModel
from toolkit.train.reporters import open_sinks
from toolkit.train.runtime import Runtime
from toolkit.train.trainstate import TrainState
from toolkit.train.update import Outcome, Update


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA allocated on ``device``, else the resident set's high-water mark."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


class Window:
    """Throughput and timing between two logged steps: only the time inside steps counts, from asking for a
    step's batch (``Reporter.timed``, which adds the data waits) to its ``step_done``. Evaluation and
    checkpoints between steps do not: the quickstart logged 38 samples/s after an in-training evaluation
    and about 5,000 otherwise, and its samples/s curve dipped to 0 at every evaluation."""

    def __init__(self, now: float):
        self.step_start = now
        self.steps, self.data_wait_s, self.busy_s = 0, 0.0, 0.0

    def step_ended(self, now: float) -> None:
        self.steps += 1
        self.busy_s += now - self.step_start

    def flush(self, batch_size: int, device: torch.device, world_size: int = 1) -> dict[str, Any]:
        """samples/s (in all and per device, as open_clip logs them), step and data-wait times, bytes sent
        per step, peak memory; restarts the window."""
        busy, steps = max(self.busy_s, 1e-9), max(self.steps, 1)
        comm = D.LEDGER.step()
        rate = self.steps * batch_size / busy
        out = {
            "samples_per_s": rate,
            "samples_per_s_per_device": rate / world_size,
            "step_time_s": busy / steps,
            "data_wait_s": self.data_wait_s / steps,
            "comm_bytes": comm["comm/total/sent_bytes"] / steps,
            "peak_mem_bytes": peak_memory_bytes(device),
        }
        self.steps, self.data_wait_s, self.busy_s = 0, 0.0, 0.0
        return out


class Reporter:
    """One run's reporting (module docstring): ``cfg`` is ``TrainConfig.report_plan()``. ``resume_step``: the
    step the run continues from (metrics and audit lines after it are cut), None for a fresh run (they are
    removed); ``record``: the run's whole config as the sinks store it (wandb's run config). Collective to
    build."""

    def __init__(
        self,
        cfg: ReportPlan,
        rt: Runtime,
        steps: StepCounts,
        resume_step: int | None,
        record: dict[str, Any] | None = None,
    ):
        self.cfg, self.rank, self.device, self.world_size = cfg, rt.rank, rt.device, rt.world_size
        self.steps_per_epoch = steps.per_epoch
        self.writer = self.progress = self.audit = None
        if rt.rank == 0:
            sinks = open_sinks(list(cfg.report_to), cfg.out, record or {}, resume_step)
            self.writer = MetricsWriter(
                cfg.out,
                cfg.tensorboard and "tensorboard" in cfg.report_to,
                resume_step,
                jsonl="jsonl" in cfg.report_to,
                sinks=sinks,
            )
            self.progress = Progress(steps.total, resume_step or 0)
            SampleAudit.reset(cfg.out, resume_step)
        D.barrier()  # no rank records before rank 0 has cut the logs back to the resume point
        if cfg.audit_samples:
            self.audit = SampleAudit(cfg.out, rt.rank, rt.world_size)
        self.window = Window(time.monotonic())

    def timed(self, batches: Iterable[dict]) -> Iterator[dict]:
        """``batches``, counting the time spent waiting for each one as the window's data wait."""
        it = iter(batches)
        while True:
            start = self.window.step_start = time.monotonic()  # the step starts with asking for its batch
            try:
                batch = next(it)
            except StopIteration:
                return
            self.window.data_wait_s += time.monotonic() - start
            yield batch

    def step_done(self, state: TrainState, batch: dict, outcome: Outcome, lr: float, update: Update) -> None:
        """After each step (every rank): the audit line, then at logged steps rank 0's metrics record."""
        self.window.step_ended(time.monotonic())
        if self.audit is not None:
            self.audit.record(state.step, batch["index"].tolist(), skipped=not outcome.applied)
        if state.step % self.cfg.log_every == 0 or state.step == update.total_steps:
            if self.writer is not None:
                grad_norm = float(outcome.grad_norm) if outcome.applied else None
                self.log(
                    state,
                    {
                        "epoch": (state.step - 1) // self.steps_per_epoch,
                        "loss": float(outcome.value),
                        "lr": lr,
                        "tau": update.temperature(),
                        **update.loss_fn.metrics(),
                        "grad_norm": grad_norm,
                        **self.window.flush(self.cfg.batch_size, self.device, self.world_size),
                    },
                )
            else:
                self.window.flush(self.cfg.batch_size, self.device)  # every rank's ledger window restarts

    def log(self, state: TrainState, metrics: dict[str, Any], quiet: bool = False) -> None:
        """Rank 0: one metrics record for ``state.step`` (and the progress line unless ``quiet``)."""
        if self.writer is None or not metrics:
            return
        epoch = metrics.pop("epoch", (state.step - 1) // self.steps_per_epoch)
        self.writer.write(
            {
                "step": state.step,
                "epoch": epoch,
                "samples_seen": state.samples_seen,
                "skipped_steps": state.skipped_steps,
                **metrics,
            }
        )
        if not quiet and self.progress is not None:
            self.progress.update(
                state.step,
                metrics.get("loss", float("nan")),
                metrics.get("samples_per_s", 0.0),
                metrics.get("step_time_s"),
            )

    def plots(self) -> None:
        """Rank 0: OUT/plots from metrics.jsonl (after each checkpoint and at the end)."""
        if self.rank == 0:
            write_plots(self.cfg.out)

    def final_model(self, built: BuiltModel) -> str:
        """Rank 0 writes OUT/model (the open_clip model: weights, config, preprocessing); returns its path."""
        model_dir = str(Path(self.cfg.out) / "model")
        if self.rank == 0:
            weights.save_model(built.model.clip, built.model_cfg, model_dir, built.preprocess_cfg)
        return model_dir

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.writer is not None:
            self.writer.close()
