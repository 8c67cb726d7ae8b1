"""A watchdog for a job whose ranks stopped making progress: name the rank instead of waiting out the
collectives' 30-minute timeout.

A rank that is stopped (SIGSTOP, a debugger, a swapped-out node) or stuck leaves every other rank waiting
inside a collective, silently, until the process group's timeout. So every rank of a multi-process job keeps
a heartbeat file ``OUT/.heartbeat/rank-R.json`` ({rank, pid, host, step, step_at, beat_at}), rewritten every
``BEAT_S`` seconds by a daemon thread (:class:`Heartbeat`; the loop sets ``step`` after each step), and the
launcher (:class:`Watch`, polled by ``supervise.Supervisor.wait``) stops the job with one line naming the
rank once no rank has reached a new step for ``watchdog_s`` seconds (counted from the job's first step;
start-up is bounded by the rendezvous deadline and the collectives' own timeout): the rank whose heartbeat
went quiet (its process stopped or hung), else the one furthest behind. Times are wall-clock seconds (ranks
and the launcher may be different processes on one host; on several hosts OUT is shared and clocks are assumed
synchronised to well under ``watchdog_s``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time

from toolkit.core import files

HEARTBEAT_DIR = ".heartbeat"
BEAT_S = 2.0  # how often a rank's thread rewrites its heartbeat
QUIET_BEATS = 5  # a heartbeat this many beats old: the rank's process is stopped or hung
CHECK_S = 2.0  # how often the launcher reads the heartbeats


class WorkerStalled(RuntimeError):
    """No rank reached a new step for ``watchdog_s`` seconds; the message names the rank to look at."""


class Heartbeat:
    """This rank's heartbeat file (module docstring). ``start`` on every rank; set ``step`` after each
    step."""

    def __init__(self, out: str, rank: int):
        self.path = os.path.join(files.local_path(out), HEARTBEAT_DIR, f"rank-{rank}.json")
        self.rank, self.step, self.step_at, self.stepping = rank, 0, time.time(), False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cliptk-heartbeat", daemon=True)

    @classmethod
    def start(cls, out: str, rank: int) -> Heartbeat | None:
        """A running heartbeat, or None where nobody watches (one process, or a remote run directory)."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or not files.is_local(out):
            return None
        beat = cls(out, rank)
        os.makedirs(os.path.dirname(beat.path), exist_ok=True)
        beat._thread.start()
        return beat

    def reached(self, step: int) -> None:
        """Called by the training loop after each step (any rank)."""
        self.step, self.step_at, self.stepping = step, time.time(), True

    def _run(self) -> None:
        while not self._stop.is_set():
            record = {
                "rank": self.rank,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "step": self.step,
                "stepping": self.stepping,
                "step_at": self.step_at,
                "beat_at": time.time(),
            }
            try:
                files.write_json_atomic(self.path, record)
            except OSError:
                pass  # a full disk is reported by the checkpoint writer; the watchdog then sees a quiet rank
            self._stop.wait(BEAT_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=BEAT_S * 2)
        try:
            os.unlink(self.path)
        except OSError:
            pass


def _process_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return {
        "T": "its process is stopped (SIGSTOP or a debugger): SIGCONT resumes it",
        "t": "its process is stopped by a debugger",
        "D": "its process waits on the disk",
        "Z": "its process has exited",
    }.get(state, "")


class Watch:
    """The launcher's side: ``check()`` raises :class:`WorkerStalled` when the job stalled (module docstring).
    ``watchdog_s`` 0 turns it off. Earlier runs' heartbeats are removed (the launcher holds the run's
    lock)."""

    def __init__(self, out: str, watchdog_s: float):
        self.folder = os.path.join(files.local_path(out), HEARTBEAT_DIR)
        self.watchdog_s = watchdog_s
        self._next_check = 0.0
        if files.is_local(out):
            shutil.rmtree(self.folder, ignore_errors=True)

    def _beats(self) -> list[dict]:
        beats = []
        try:
            names = sorted(os.listdir(self.folder))
        except OSError:
            return []
        for name in names:
            try:
                with open(os.path.join(self.folder, name)) as fh:
                    beats.append(json.load(fh))
            except (OSError, ValueError):
                continue  # being replaced right now: read at the next check
        return beats

    def check(self) -> None:
        if not self.watchdog_s or time.monotonic() < self._next_check:
            return
        self._next_check = time.monotonic() + CHECK_S
        beats, now = self._beats(), time.time()
        # start-up (model build, data, resume) is not watched: the clock starts at the job's first step
        if (
            not any(b.get("stepping") for b in beats)
            or now - max(b["step_at"] for b in beats) < self.watchdog_s
        ):
            return
        quiet = [b for b in beats if now - b["beat_at"] > QUIET_BEATS * BEAT_S]
        culprit = min(quiet or beats, key=lambda b: (b["step"], b["beat_at"]))
        state = _process_state(culprit["pid"]) if culprit["host"] == socket.gethostname() else ""
        why = (
            f"its heartbeat stopped {now - culprit['beat_at']:.0f} s ago"
            if quiet
            else "it is the furthest behind"
        ) + (f"; {state}" if state else "")
        raise WorkerStalled(
            f"rank {culprit['rank']} (pid {culprit['pid']} on {culprit['host']}) has not reached step "
            f"{culprit['step'] + 1}, and no rank has finished a step for "
            f"{now - max(b['step_at'] for b in beats):.0f} "
            f"s (watchdog_s={self.watchdog_s:g}): {why}; the job was stopped, rerun to resume from the "
            "newest "
            "checkpoint"
        )
