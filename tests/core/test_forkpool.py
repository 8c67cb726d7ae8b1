"""Forked workers end every time (issue 44): default signal dispositions in each worker, a bounded join after
the work, terminate only on failure, and a worker that dies holding a task named instead of waited for."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from toolkit.core import forkpool

ROOT = Path(__file__).resolve().parents[2]


def _dispositions(job, task, on_read):
    on_read(1)
    return task, os.getpid(), [signal.getsignal(s) for s in forkpool.WORKER_SIGNALS]


def test_workers_restore_default_dispositions_whatever_the_parent_handles():
    caught = []
    handler = lambda signum, frame: caught.append(signum)  # noqa: E731 - a handler that does not end it
    previous = {s: signal.signal(s, handler) for s in forkpool.WORKER_SIGNALS}
    try:
        results, progress = [], []
        forkpool.run(_dispositions, None, list(range(6)), 2, results.append, on_progress=progress.append)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    assert sorted(r[0] for r in results) == list(range(6)) and len({r[1] for r in results}) == 2
    assert all(r[2] == [signal.SIG_DFL] * len(forkpool.WORKER_SIGNALS) for r in results)
    assert progress[-1] == 6  # every on_read(1) counted


# A parent whose SIGTERM handler does not end a process (the trainer's preemption flag works so); task 0 fails
# while task 1 sits blocked on a lock for good, as the worker sat on the task queue's lock. The pool
# must end (terminate reaches the blocked worker) and raise task 0's error; the inherited handler hung it.
BLOCKED = textwrap.dedent("""
    import signal, sys, threading, time
    from toolkit.core import forkpool

    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    held = threading.Lock()
    held.acquire()

    def work(job, task, on_read):
        if task == 0:
            time.sleep(0.5)  # task 1 is blocked by now
            raise ValueError("task 0 failed")
        held.acquire()  # never released: blocked in sem_wait, as on a dead worker's queue lock

    start = time.monotonic()
    try:
        forkpool.run(work, None, [0, 1], 2, lambda r: None)
    except ValueError as err:
        print("raised", err, round(time.monotonic() - start, 1))
""")


def test_a_worker_blocked_on_a_lock_when_the_pool_fails_is_ended():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("raised task 0 failed"), done.stdout + done.stderr[-2000:]
    assert "did not exit" not in done.stderr  # SIGTERM ended it: no kill after the deadline was needed


def _leaves_a_thread(job, task, on_read):
    threading.Thread(target=time.sleep, args=(3600,)).start()  # not a daemon: the worker cannot exit
    return task


def test_a_worker_that_does_not_exit_after_the_work_is_reported_and_killed(monkeypatch, caplog):
    monkeypatch.setattr(forkpool, "JOIN_TIMEOUT_S", 1.0)
    results = []
    start = time.monotonic()
    forkpool.run(_leaves_a_thread, None, [1, 2, 3], 2, results.append, name="test pool")
    assert sorted(results) == [1, 2, 3]
    assert time.monotonic() - start < 30
    assert "test pool: worker process(es)" in caplog.text
    assert "did not exit within 1 s of the end of the work" in caplog.text


def _dies_on_two(job, task, on_read):
    if task == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer's way
    return task


def test_a_worker_that_dies_holding_a_task_fails_the_run_naming_it():
    with pytest.raises(RuntimeError, match=r"died with exit code -9 while processing 2"):
        forkpool.run(_dies_on_two, None, [1, 2, 3, 4], 2, lambda r: None)


class Unpicklable(Exception):
    def __init__(self, message, handle):
        super().__init__(message)
        self.handle = handle

    def __reduce__(self):
        raise TypeError("no pickling")


def _fails(job, task, on_read):
    if task == "os":
        raise OSError(28, "No space left on device")
    raise Unpicklable("odd failure", threading.Lock())


def test_a_task_error_is_raised_as_itself_with_the_workers_traceback():
    with pytest.raises(OSError, match="No space left") as info:
        forkpool.run(_fails, None, ["os"], 2, lambda r: None)
    assert info.value.errno == 28 and "in a worker process" in info.value.__notes__[0]
    with pytest.raises(RuntimeError, match="Unpicklable: odd failure"):
        forkpool.run(_fails, None, ["odd"], 2, lambda r: None)


def test_the_job_reaches_every_worker_unpickled():
    job = {"lock": threading.Lock(), "token": object()}  # neither pickles: the fork hands it over
    results = []
    kind = lambda job, task, on_read: (task, type(job["lock"]).__name__)  # noqa: E731
    forkpool.run(kind, job, [1, 2, 3], 2, results.append)
    assert sorted(results) == [(1, "lock"), (2, "lock"), (3, "lock")]
