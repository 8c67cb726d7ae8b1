"""What every section of the GPU check shares: the run context, a section's record and time budget,
subprocess helpers, timing on CUDA, and the printed table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.shared import trainer_bench as tb
from benchmarks.shared.trainer_bench import PY, REPO, toolkit_cmd  # noqa: F401 (the sections' shared names)

GiB = 1024**3


@dataclass
class Context:
    """One check run: where it works, what it runs on, and whether sizes are the dry run's."""

    work: Path
    device: str  # "cuda" or "cpu" (the dry run)
    dry_run: bool
    open_clip_deps: str | None = None  # a folder with webdataset<=0.2.86 for open_clip_train
    shared: dict = field(default_factory=dict)  # what one section leaves for a later one (raw shards, ...)


@dataclass
class Section:
    """One section's record. ``budget_s``: its share of the check's time; ``left_s()`` what remains."""

    name: str
    budget_s: float
    rows: list[dict] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    wall_s: float = 0.0
    started: float = field(default_factory=time.perf_counter, repr=False)

    def left_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def skip(self, case: str, why: str) -> None:
        self.skipped.append(f"{case}: {why}")

    def to_json(self) -> dict:
        out = asdict(self)
        out.pop("started")
        return out


def env_with_repo(extra: str | None = None) -> dict[str, str]:
    """A child's environment: this checkout first on PYTHONPATH (``extra`` before it), no hub access."""
    return tb.env_with_repo(extra) | {
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled"),
    }


def run_cmd(cmd: list[str], timeout_s: float, log: Path, env: dict | None = None) -> tuple[int | None, float]:
    """Run ``cmd`` with its output in ``log``; (exit code or None when it ran past ``timeout_s``, wall s)."""
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env or env_with_repo(), start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout=max(timeout_s, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            code = None
    return code, time.perf_counter() - start


def tail(path: Path, num_lines: int = 3) -> str:
    """The last lines of a log, on one line (for a row's status)."""
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return " | ".join(lines[-num_lines:])[-400:]


def synchronize(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def timed_ms(fn, device: str) -> float:
    """Wall milliseconds of ``fn()`` with the device's queue drained before and after."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return (time.perf_counter() - start) * 1e3


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def progress(section: str, row: dict) -> None:
    """One finished case on one line, as it finishes (a run stopped from outside still shows it)."""
    print(f"[{section}] " + "  ".join(f"{k}={fmt(v)}" for k, v in row.items()), flush=True)


def print_section(sec: Section) -> None:
    """The section's rows as an aligned text table, then its skipped cases and notes."""
    print(f"\n== {sec.name} ({sec.wall_s:.0f} s of {sec.budget_s:.0f} s budget) ==")
    if sec.error:
        print(f"ERROR: {sec.error}")
    if sec.rows:
        cols = list(dict.fromkeys(k for r in sec.rows for k in r))
        cells = [[fmt(r.get(c)) for c in cols] for r in sec.rows]
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
        print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
        for row in cells:
            print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
    for s in sec.skipped:
        print(f"skipped: {s}")
    for n in sec.notes:
        print(f"note: {n}")
    sys.stdout.flush()


def write_json(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str))
