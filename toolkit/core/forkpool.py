"""Forked worker processes that run ``fn(job, task, on_read)`` over a list of tasks (precompute's pool).

The job (loaded models, a tokenizer: anything, pickled or not) is handed to each worker as the argument of
its process, inherited through the fork and shared copy-on-write; only tasks and results travel, each
worker over its own pipe, so no worker ever waits on a lock another worker may hold.

How it ends. Issue 44's hang: ``multiprocessing.Pool`` left through ``with`` calls ``terminate()`` even
after normal completion; its ``_help_stuff_finish`` takes the task queue's lock in the parent and keeps it,
so a worker waiting for its next task blocks on that lock (``sem_wait``) until the SIGTERM that follows.
The worker had inherited the CLI's Python handler (``procs.stop_on_signals``), which runs only when the
interpreter's main thread gets control back; the kernel delivers a process's signal to any of its threads,
and precompute's workers have more than one (pyarrow's thread pool, started by reading a shard's
``.parquet``): when the signal lands on one of those, ``sem_wait`` is not interrupted, the handler never
runs, the worker never exits and the parent's ``join`` waits forever (seen with gdb: main thread in
``sem_wait``, two ``arrow::ThreadPool`` threads, SIGTERM caught). Here instead:

- each worker first restores the default disposition of SIGTERM, SIGINT and SIGHUP, so a signal ends it
  wherever it is blocked, and dies with its parent (``PR_SET_PDEATHSIG``);
- after normal completion each worker is told to stop (``None`` on its pipe) and joined; a worker that
  has not exited ``JOIN_TIMEOUT_S`` later is reported and killed;
- on a failure or an interruption (an exception in a task or in ``on_result``, Ctrl-C, SIGTERM) the
  workers are terminated (SIGTERM), then joined the same bounded way;
- a worker that dies while it holds a task (the kernel's OOM killer, a crash in native code) fails the
  run naming the task, where ``Pool`` would wait for its result forever.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from toolkit.core.log import get_logger

# The parent looks at its workers (and moves the progress display) this often, in seconds.
POLL_S = 0.5
# How long workers told to stop (or terminated) may take to exit before they are killed. Two precompute
# workers told to stop were all gone 0.33-0.43 s later (3 runs, 2 cores at load 14, interpreter exit
# included); 30 s leaves room for a far busier machine.
JOIN_TIMEOUT_S = 30.0
# Signals a worker must not handle the parent's way (SIGHUP and SIGTERM: procs.stop_on_signals; SIGINT:
# Python's KeyboardInterrupt): with the default action a signal ends it even inside a blocking call.
WORKER_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, n))


@dataclass
class _Worker:
    process: Any
    conn: Any
    task: Any = None  # the task it holds, None when idle


def run(
    fn: Callable[[Any, Any, Callable[[int], None]], Any],
    job: Any,
    tasks: Sequence[Any],
    num_workers: int,
    on_result: Callable[[Any], None],
    *,
    start: Callable[[], None] | None = None,
    on_progress: Callable[[int], None] | None = None,
    name: str = "pool",
) -> None:
    """Run ``fn(job, task, on_read)`` for every task in ``num_workers`` forked workers; ``on_result(result)``
    in this process as each finishes (in completion order). ``on_read(n)`` in a worker adds ``n`` to a shared
    counter that ``on_progress(total)`` receives every POLL_S seconds. ``start()`` runs first in each worker.
    A task's exception is raised here as itself (its worker's traceback in a note). Called by one process."""
    ctx = mp.get_context("fork")
    counter = ctx.Value("q", 0)
    workers: list[_Worker] = []
    pending = list(reversed(tasks))
    try:
        for _ in range(min(num_workers, len(tasks))):
            mine, theirs = ctx.Pipe()
            process = ctx.Process(
                target=_serve, args=(fn, job, theirs, counter, os.getpid(), start), daemon=True
            )
            process.start()
            theirs.close()
            workers.append(_Worker(process, mine))
        for w in workers:
            _give(w, pending)
        while any(w.task is not None for w in workers):
            _collect(workers, pending, on_result)
            if on_progress is not None:
                on_progress(counter.value)
    except BaseException:
        _end(workers, name, terminate=True)
        raise
    _end(workers, name, terminate=False)
    if on_progress is not None:
        on_progress(counter.value)


def _give(w: _Worker, pending: list) -> None:
    if pending:
        w.task = pending.pop()
        w.conn.send(w.task)


def _collect(workers: list[_Worker], pending: list, on_result: Callable[[Any], None]) -> None:
    """Wait up to POLL_S for results; hand each worker that answered its next task. A busy worker that
    exited without answering: RuntimeError naming its task."""
    busy = [w for w in workers if w.task is not None]
    ready = set(wait([w.conn for w in busy] + [w.process.sentinel for w in busy], timeout=POLL_S))
    for w in busy:
        if w.conn not in ready and w.process.sentinel not in ready:
            continue
        try:
            answer = w.conn.recv() if w.conn.poll() else None
        except EOFError:  # its end of the pipe closed without an answer: it died
            answer = None
        if answer is None:
            w.process.join(JOIN_TIMEOUT_S)  # the pipe closes just before the process can be reaped
            task = getattr(w.task, "url", w.task)
            raise RuntimeError(
                f"a worker process (pid {w.process.pid}) died with exit code "
                f"{w.process.exitcode} while processing {task} (killed for lack of memory?)"
            )
        ok, payload = answer
        if not ok:
            raise payload
        w.task = None
        on_result(payload)
        _give(w, pending)


def _end(workers: list[_Worker], name: str, terminate: bool) -> None:
    """Stop every worker: told to (normal end) or SIGTERM (failure); a bounded join, then SIGKILL,
    reported."""
    for w in workers:
        try:
            if terminate:
                w.process.terminate()
            else:
                w.conn.send(None)
        except (OSError, ValueError):  # already gone: its pipe is closed
            pass
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))
    stuck = [w.process for w in workers if w.process.is_alive()]
    if stuck:
        get_logger("core.forkpool").warning(
            "%s: worker process(es) %s did not exit within %.0f s of the %s; killed",
            name,
            ", ".join(str(p.pid) for p in stuck),
            JOIN_TIMEOUT_S,
            "failure" if terminate else "end of the work",
        )
        for p in stuck:
            p.kill()
            p.join(JOIN_TIMEOUT_S)
    for w in workers:
        w.conn.close()


def _serve(fn, job, conn, counter, parent_pid: int, start) -> None:
    """A worker: default signal dispositions, die with the parent, then tasks from ``conn`` until ``None``."""
    from toolkit.core.procs import die_with_parent

    for sig in WORKER_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    die_with_parent(parent_pid=parent_pid)  # a SIGKILLed parent leaves no worker running

    def on_read(n: int) -> None:
        with counter.get_lock():
            counter.value += n

    if start is not None:
        start()
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the parent closed the pipe
            return
        if task is None:
            return
        try:
            reply = (True, fn(job, task, on_read))
        except Exception as err:  # noqa: BLE001 - every failure goes back to the parent, which raises it
            reply = (False, _portable(err))
        conn.send(reply)


def _portable(err: Exception) -> Exception:
    """``err`` with its traceback as a note, or a RuntimeError of its text when it does not pickle."""
    import pickle

    note = "(in a worker process:\n" + "".join(traceback.format_exception(err)) + ")"
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001 - an exception whose arguments do not pickle
        err = RuntimeError(f"{type(err).__name__}: {err}")
    err.add_note(note)
    return err
