"""The launcher's watch over torchrun's elastic agent: signals, the rendezvous deadline, a hard stop.

The agent runs in a child process (``toolkit.core.agent``) in its own session, and the launcher waits for
it in Python, polling every ``POLL_S``. In the earlier design torchrun ran inside the launcher, which then
spent its rendezvous inside a C++ TCPStore call: Python signal handlers never ran there, so SIGTERM and
SIGINT were ignored and only SIGKILL ended a launcher whose port was held by another server (issue 25).

- ``LauncherSignals``: SIGTERM, SIGINT, SIGHUP and SIGUSR1 are only recorded by the handler; the wait loop
  acts on them.
- ``Supervisor.wait``: the first signal while workers run is passed on to them (they finish the step,
  write a checkpoint and exit 0, and the agent ends normally); a signal before any worker started, or a
  second one, stops the agent and every worker at once (``stop_tree``) and raises
  :class:`~toolkit.core.stage.StageInterrupted`; no worker within ``rendezvous_timeout_s`` stops them too
  and raises :class:`RendezvousTimeout` naming what the launcher waited for.
Main thread only (signal handlers); every name here is called by the launching process, never by a rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from contextlib import suppress
from pathlib import Path
from types import FrameType

from toolkit.core.log import get_logger
from toolkit.core.stage import StageInterrupted

POLL_S = 0.2  # the launcher's reaction time to a signal or a deadline
KILL_WAIT_S = 10.0  # after SIGKILL, how long to wait for the processes to be reaped before giving up
HANDLED = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1") if hasattr(signal, n))


class RendezvousTimeout(RuntimeError):
    """No worker started within the rendezvous timeout; the message names what the launcher waited for."""


class LauncherSignals:
    """Records the signals in ``HANDLED`` while installed (``with``); ``pop()`` returns the oldest one."""

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.count = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> LauncherSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in HANDLED}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.pending.append(signum)
        self.count += 1

    def pop(self) -> int | None:
        return self.pending.pop(0) if self.pending else None

    def check(self, waiting_for: str) -> None:
        """Raise StageInterrupted if a signal arrived (used by waits that start no process)."""
        if (sig := self.pop()) is not None:
            raise StageInterrupted(
                f"interrupted by {signal.Signals(sig).name} while waiting for {waiting_for}; "
                "no worker had started, nothing was trained"
            )


def child_pids(pid: int) -> list[int]:
    """Processes whose parent is ``pid``: from /proc on Linux, else from ``pgrep -P`` (macOS, BSD)."""
    if not Path("/proc/self/stat").exists():
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout
        return [int(p) for p in out.split()]
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


# torchrun sets it in each worker's environment only (local_elastic_agent's worker env); other children of the
# agent (a short-lived helper during the rendezvous) lack it, and counting those as workers once made a
# signal sent while waiting for a peer node report "restarting its workers" (a flake of test_launch_waits)
WORKER_ENV_KEY = b"TORCHELASTIC_RESTART_COUNT="


def worker_pids(agent_pid: int) -> list[int]:
    """torchrun's worker processes under the agent ``agent_pid``: its children whose environment carries
    ``WORKER_ENV_KEY`` (Linux); every child where /proc has no environments to read (macOS, BSD)."""
    children = child_pids(agent_pid)
    if not Path("/proc/self/environ").exists():
        return children
    workers = []
    for pid in children:
        with suppress(OSError):
            if WORKER_ENV_KEY in Path(f"/proc/{pid}/environ").read_bytes():
                workers.append(pid)
    return workers


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun's workers, their DataLoader workers), parents first."""
    out, frontier = [], [pid]
    while frontier:
        children = [c for p in frontier for c in child_pids(p)]
        out += children
        frontier = children
    return out


def stop_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the agent and everything below it (workers run in sessions of their own, so a process-group
    kill would miss them); the list is taken before the agent dies, while the workers are still its
    children, and once more after, for a worker started in between."""
    seen: set[int] = set()
    for _ in range(2):
        pids = [p for p in [*descendants(proc.pid), proc.pid] if p not in seen]
        for pid in pids:
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        seen.update(pids)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=KILL_WAIT_S)


class Supervisor:
    """Waits for the agent process ``proc`` (module docstring). ``waiting_for`` names the rendezvous."""

    def __init__(
        self, proc: subprocess.Popen, signals: LauncherSignals, waiting_for: str, rendezvous_timeout_s: float
    ):
        self.proc, self.signals, self.waiting_for = proc, signals, waiting_for
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.workers_started = False
        self.forwarded: int | None = None  # the signal passed on to the workers, if any
        self.watch = None  # a toolkit.core.watchdog.Watch: stops a job whose ranks stalled, naming the rank
        self.what = (
            "training"  # the job, as messages name it: training checkpoints; another job (precompute) keeps
        )
        # its finished work its own way

    def wait(self) -> int:
        """Block until the agent exits; returns its exit code. Raises StageInterrupted or RendezvousTimeout
        after stopping the agent and its workers."""
        deadline = time.monotonic() + self.rendezvous_timeout_s
        try:
            while self.proc.poll() is None:
                if (sig := self.signals.pop()) is not None:
                    self._on_signal(sig)
                if not self.workers_started:
                    self.workers_started = bool(worker_pids(self.proc.pid))
                    if not self.workers_started and time.monotonic() > deadline:
                        raise RendezvousTimeout(
                            f"no rendezvous within {self.rendezvous_timeout_s:g} s "
                            "(launch.rendezvous_timeout_s): "
                            f"waited for {self.waiting_for}"
                        )
                elif self.watch is not None:
                    self.watch.check()
                time.sleep(POLL_S)
        except BaseException:
            stop_tree(self.proc)
            raise
        return self.proc.returncode

    def _on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        log = get_logger("train")
        workers = worker_pids(self.proc.pid)
        training = self.what == "training"
        resume = "resume from the newest checkpoint" if training else "resume (finished work is kept)"
        signum = None if training else sig  # exit 128 + sig; the trainer's launcher keeps its exit code 1
        if not workers and self.workers_started:
            raise StageInterrupted(
                f"interrupted by {name} while the agent was restarting its workers; rerun the "
                f"same command to {resume}",
                signum,
            )
        if not workers:
            raise StageInterrupted(
                f"interrupted by {name} while waiting for {self.waiting_for}; "
                f"no worker had started, nothing was {'trained' if training else 'done'}",
                signum,
            )
        if self.forwarded is not None:
            raise StageInterrupted(
                f"interrupted by a second signal ({name}): the workers were stopped at once"
                + (
                    ", without a checkpoint; rerun the same command to resume from the newest one"
                    if training
                    else f"; rerun the same command to {resume}"
                ),
                signum,
            )
        passed = signal.SIGTERM if sig == getattr(signal, "SIGHUP", None) else sig
        log.warning(
            "launcher received %s: passing it to the %d worker(s), which %s (send it again to stop them "
            "at once)",
            name,
            len(workers),
            "finish their step, write a checkpoint and exit"
            if training
            else f"stop and exit ({self.what}: finished work is kept)",
        )
        for pid in workers:
            with suppress(ProcessLookupError):
                os.kill(pid, passed)
        self.forwarded = sig
