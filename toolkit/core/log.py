"""Logging set-up, a JSON-lines log file, and progress that degrades to log lines off a TTY."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")
_STATE = {"quiet": False}
# "1" in processes a quiet launcher started (torchrun's agent, the workers): quiet as if given --quiet
QUIET_ENV = "CLIPTK_QUIET"
LOGGER_NAME = "toolkit"
# Off a TTY, progress is logged at most this often so CI logs show liveness without flooding.
PROGRESS_LOG_INTERVAL_S = 10.0


def get_logger(name: str = "") -> logging.Logger:
    return logging.getLogger(f"{LOGGER_NAME}.{name}" if name else LOGGER_NAME)


class _CurrentStderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time of the record, not the one at set-up: a caller
    that swaps stderr (typer's CliRunner, a notebook capturing output) and closes its copy afterwards would
    otherwise make every later record fail with 'I/O operation on closed file'."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(level: str = "INFO", quiet: bool = False) -> None:
    """Called once by the CLI entry point: human-readable records on stderr."""
    _STATE["quiet"] = quiet
    logger = get_logger()
    logger.setLevel(level.upper())
    if not any(getattr(h, "_toolkit_console", False) for h in logger.handlers):
        handler = _CurrentStderrHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        handler._toolkit_console = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.propagate = False
    if quiet:
        for h in logger.handlers:
            if getattr(h, "_toolkit_console", False):
                h.setLevel(logging.WARNING)


def is_quiet() -> bool:
    return _STATE["quiet"] or os.environ.get(QUIET_ENV) == "1"


class JsonLinesHandler(logging.Handler):
    """Appends one JSON object per record: time, level, logger, message, and any ``extra={'data': ...}``."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        entry = {
            "time": record.created,
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if isinstance(getattr(record, "data", None), dict):
            entry["data"] = record.data  # type: ignore[attr-defined]
        try:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(entry, default=str) + "\n")
        except OSError:
            self.handleError(record)


@contextmanager
def jsonl_log(path: str) -> Iterator[None]:
    """Mirror every toolkit log record into ``path`` while the block runs."""
    logger = get_logger()
    handler = JsonLinesHandler(path)
    handler.setLevel(logging.DEBUG)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


class ProgressCounter:
    """A progress display advanced by hand: a rich bar on a TTY, else a log line every ~10 s.

    For work whose unit of progress is not the item being iterated (samples inside shards); see
    :func:`counter`. ``advance(n)`` may be called as often as once per sample: it is cheap off a TTY.
    """

    def __init__(self, total: int | None, desc: str, unit: str, bar=None, task=None):
        self.total, self.desc, self.unit, self.bar, self.task = total, desc, unit, bar, task
        self.done, self.start = 0, time.monotonic()
        self.last = self.start
        self.log = get_logger("progress")

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done)
            return
        now = time.monotonic()
        if n and now - self.last >= PROGRESS_LOG_INTERVAL_S:
            self.last = now
            of = f"/{self.total}" if self.total else ""
            rate = self.done / max(now - self.start, 1e-9)
            self.log.info("%s: %d%s %s (%.1f %s/s)", self.desc, self.done, of, self.unit, rate, self.unit)


@contextmanager
def counter(total: int | None, desc: str = "", unit: str = "it") -> Iterator[ProgressCounter]:
    """A :class:`ProgressCounter` for the block; ``total`` None shows a count without an end."""
    if not is_quiet() and sys.stderr.isatty():
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        columns = [
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(unit),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        ]
        with Progress(*columns, transient=False) as bar:
            yield ProgressCounter(total, desc, unit, bar, bar.add_task(desc, total=total))
        return
    yield ProgressCounter(total, desc, unit)


def progress(items: Iterable[T], total: int | None = None, desc: str = "", unit: str = "it") -> Iterator[T]:
    """Yield ``items`` with a rich progress bar on a TTY, else a log line every ~10 s."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with counter(total, desc, unit) as count:
        for item in items:
            yield item
            count.advance()
