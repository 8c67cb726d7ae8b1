"""What rank 0 reports while training: ``metrics.jsonl``, TensorBoard events, PNG curves, a progress bar.

``metrics.jsonl`` has one JSON object per logged step with at least ``step`` (optimiser steps done, 1 at
the first), ``epoch``, ``samples_seen``, ``loss``, ``lr``, ``tau``, ``gamma``, ``samples_per_s``,
``step_time_s``, ``data_wait_s``, ``comm_bytes``, ``peak_mem_bytes``, ``skipped_steps`` (plus
``grad_norm`` and ``eval/<dataset>/<metric>`` when evaluation ran). A resumed run first drops the
lines after its checkpoint's step, so the file continues without a gap or a repeated step.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from toolkit.core.log import PROGRESS_LOG_INTERVAL_S, get_logger, is_quiet

METRICS = "metrics.jsonl"
PLOTTED = ("loss", "lr", "tau", "gamma", "samples_per_s", "grad_norm")


def truncate_after(path: Path, step: int) -> int:
    """Keep the lines of ``path`` whose step is <= ``step`` (a resume); returns how many were dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            keep = json.loads(line)["step"] <= step
        except ValueError:
            keep = False  # a line cut by a crash
        kept.append(line) if keep else None
        dropped += not keep
    path.write_text("".join(f"{line}\n" for line in kept))
    return dropped


class MetricsWriter:
    """Appends metric records (rank 0 only) to metrics.jsonl unless ``jsonl`` is off; mirrors scalars to
    TensorBoard when enabled and hands each record to the ``sinks`` (``train.reporters``: wandb)."""

    def __init__(
        self,
        run_dir: str,
        tensorboard: bool,
        resume_step: int | None,
        jsonl: bool = True,
        sinks: list[Any] | None = None,
    ):
        self.run_dir, self.jsonl, self.sinks = Path(run_dir), jsonl, list(sinks or [])
        self.path = self.run_dir / METRICS
        if resume_step is None:
            self.path.unlink(missing_ok=True)
        else:
            truncate_after(self.path, resume_step)
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=resume_step)

    def write(self, record: dict[str, Any]) -> None:
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
        if self.jsonl:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.write(record)
        if self.tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        for sink in self.sinks:
            sink.close()


class SampleAudit:
    """``audit_samples``: OUT/samples/rank-R-of-K.jsonl, one line per step with the sample ids this rank
    trained on ({"step": steps done, "ids": [...], "skipped": bool}), so any sequence of interruptions and
    resumes can be checked for samples seen twice or never (``scripts/chaos_train.py``)."""

    DIR = "samples"

    def __init__(self, run_dir: str, rank: int, world_size: int):
        self.path = Path(run_dir) / self.DIR / f"rank-{rank}-of-{world_size}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    @classmethod
    def reset(cls, run_dir: str, resume_step: int | None) -> None:
        """Rank 0, before any rank records: drop every line after the resume step (all files, whatever
        world size wrote them), or every file for a fresh run."""
        for path in (Path(run_dir) / cls.DIR).glob("rank-*.jsonl"):
            if resume_step is None:
                path.unlink()
            else:
                truncate_after(path, resume_step)

    def record(self, step: int, ids: list[int], skipped: bool) -> None:
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"step": step, "ids": ids, "skipped": skipped}) + "\n")


def read_audit(run_dir: str) -> dict[int, list[int]]:
    """Step -> the global batch's ids (all ranks' lines, in rank order) from OUT/samples/*.jsonl."""
    parts: dict[int, list[tuple[int, list[int]]]] = {}
    for path in sorted((Path(run_dir) / SampleAudit.DIR).glob("rank-*.jsonl")):
        rank = int(path.stem.split("-")[1])
        for line in path.read_text().splitlines():
            row = json.loads(line)
            parts.setdefault(row["step"], []).append((rank, row["ids"]))
    return {step: [i for _, ids in sorted(p) for i in ids] for step, p in sorted(parts.items())}


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_plots(run_dir: str) -> list[str]:
    """PNG curves of the logged metrics (one file per metric, eval metrics included) into RUN_DIR/plots.

    Drawn with matplotlib's object API on the Agg canvas, not pyplot (whose import pulls in the backend
    machinery) and with fixed margins instead of ``tight_layout`` (a second draw per figure): this runs at
    the end of every run, so it counts in a short run's wall time (benchmarks/data/data_scale.py)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(run_dir)
    keys = [k for k in PLOTTED if any(k in r for r in records)]
    keys += sorted({k for r in records for k in r if k.startswith("eval/")})
    out_dir = Path(run_dir) / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key in keys:
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        if not points:
            continue
        fig = Figure(figsize=(6, 3.5), dpi=100)
        FigureCanvasAgg(fig)
        fig.subplots_adjust(left=0.16, right=0.97, bottom=0.15, top=0.95)  # room for the axis labels
        ax = fig.add_subplot()
        ax.plot(*zip(*points, strict=True), marker="o" if len(points) < 30 else None, markersize=3)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        path = out_dir / f"{key.replace('/', '_')}.png"
        fig.savefig(path)
        written.append(str(path))
    return written


def format_duration(seconds: float) -> str:
    """'42s', '3m05s', '2h07m': a time estimate as a progress line shows it."""
    total = max(int(round(seconds)), 0)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def final_scores(run_dir: str) -> tuple[int, dict[str, float]]:
    """(step, {"<dataset>/<metric>": value}) of the last metrics record holding evaluation results (the
    evaluation at the end of a run; the EMA weights' as "ema <dataset>/<metric>"), (0, {}) when the run
    evaluated nothing."""
    names = {"eval/": "", "eval_ema/": "ema "}
    for record in reversed(read_metrics(run_dir)):
        scores = {
            names[prefix] + k.removeprefix(prefix): v
            for k, v in record.items()
            for prefix in names
            if k.startswith(prefix) and isinstance(v, (int, float))
        }
        if scores:
            return record["step"], scores
    return 0, {}


class Progress:
    """A rich progress bar with samples/s, loss and ETA on a TTY; a log line every ~10 s otherwise."""

    def __init__(self, total_steps: int, start_step: int):
        self.total, self.done = total_steps, start_step
        self.log = get_logger("train")
        self.bar = self.task = None
        self.last_log = time.monotonic()
        if not is_quiet() and sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(
                TextColumn("train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                transient=False,
            )
            self.bar.start()
            self.task = self.bar.add_task("train", total=total_steps, completed=start_step, info="")

    def update(self, step: int, loss: float, samples_per_s: float, step_time_s: float | None = None) -> None:
        """``step_time_s``: the mean time of a recent step, for the log line's time estimate (the bar makes
        its own)."""
        info = f"loss {loss:.4f}  {samples_per_s:,.0f} samples/s"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
            return
        now = time.monotonic()
        if now - self.last_log >= PROGRESS_LOG_INTERVAL_S or step == self.total:
            self.last_log = now
            if step_time_s is not None and step < self.total:
                info += f"  eta {format_duration((self.total - step) * step_time_s)} (steps only)"
            self.log.info("step %d/%d: %s", step, self.total, info)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
