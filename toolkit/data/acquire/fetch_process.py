"""The ``fetch_worker`` subprocess seen from ``fetch``: start it in its own process group, read its
events, kill the whole group on a run timeout, and turn its URL events into progress."""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any

import toolkit
from toolkit.core.log import get_logger, progress
from toolkit.core.procs import GroupReaper, child_preexec

log = get_logger("data.fetch")
# Lines of worker output kept for the error message when the worker fails.
ERROR_TAIL_LINES = 40
# Seconds between SIGTERM and SIGKILL when a run exceeds run_timeout_s.
KILL_GRACE_S = 5.0


class WorkerRun:
    """Runs ``fetch_worker`` in its own process group; yields its events; kills it on timeout."""

    def __init__(self, spec: dict, run_timeout_s: float | None, lock_fd: int | None = None):
        fd, self.spec_path = tempfile.mkstemp(prefix="cliptk-fetch-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump(spec, fh)
        # The folder holding this very toolkit package, so the worker imports the same tree as its parent.
        root = os.path.dirname(os.path.dirname(os.path.abspath(toolkit.__file__)))
        env = {
            **os.environ,
            "NO_ALBUMENTATIONS_UPDATE": "1",
            "WANDB_MODE": "disabled",
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "toolkit.data.acquire.fetch_worker", self.spec_path],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            env=env,
            start_new_session=True,
            preexec_fn=child_preexec(),  # and it dies with this process, even on SIGKILL
            # the worker holds the output lock too: if this process dies first, the folder stays locked
            # until the worker writing into it is gone as well
            pass_fds=(lock_fd,) if lock_fd is not None else (),
        )
        # img2dataset's spawned pool and resource tracker are the worker's children, out of PDEATHSIG's reach:
        # they die with this process too, whatever kills it
        self.reaper = GroupReaper(self.proc.pid)
        self.tail: collections.deque[str] = collections.deque(maxlen=ERROR_TAIL_LINES)
        self.timed_out = False
        self.timer = threading.Timer(run_timeout_s, self._on_timeout) if run_timeout_s else None
        if self.timer:
            self.timer.daemon = True
            self.timer.start()

    def _on_timeout(self) -> None:
        self.timed_out = True
        self.kill()

    def kill(self) -> None:
        """SIGTERM the worker's process group (img2dataset's pool included), SIGKILL after a grace period."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(KILL_GRACE_S)
                return
            except subprocess.TimeoutExpired:
                continue

    def events(self):
        """Parsed events from the worker's stdout; other lines go to the debug log and the error tail."""
        from toolkit.data.acquire.fetch_worker import EVENT_PREFIX

        assert self.proc.stdout is not None
        decoder = json.JSONDecoder()
        for line in self.proc.stdout:
            for part in line.rstrip("\n").split("\r"):  # tqdm redraws with carriage returns
                # img2dataset's own output may share a line with an event (it prints without a newline
                # at times): every event in the part is decoded, the text around them is output
                chunks = part.split(EVENT_PREFIX)
                self._output(chunks[0])
                for chunk in chunks[1:]:
                    try:
                        event, end = decoder.raw_decode(chunk)
                    except json.JSONDecodeError:
                        self._output(EVENT_PREFIX + chunk)
                        continue
                    yield event
                    self._output(chunk[end:])

    def _output(self, text: str) -> None:
        if text.strip():
            self.tail.append(text)
            log.debug("img2dataset: %s", text)

    def close(self) -> int:
        if self.timer:
            self.timer.cancel()
        if self.proc.poll() is None:
            try:
                code = self.proc.wait(KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                self.kill()
                code = self.proc.wait()
        else:
            code = self.proc.returncode
        self.reaper.kill_now()  # whatever the finished worker left in its group
        os.unlink(self.spec_path)
        return code


def download(
    spec: dict, run_timeout_s: float | None, lock_fd: int | None = None, num_urls: int | None = None
) -> dict[str, Any]:
    """Run the worker with progress over URLs (``num_urls`` to download); returns the number of shards
    planned and whether the run timed out. Raises RuntimeError naming the last output line if it fails."""
    worker = WorkerRun(spec, run_timeout_s, lock_fd)
    planned = 0
    try:
        events = worker.events()
        for event in events:
            if "plan" in event:
                planned = event["plan"]["num_shards"]
                log.info(
                    "fetch: %d URLs in %d shards to download (%d shards already finished)",
                    num_urls or 0,
                    planned,
                    len(spec["done_shards"]),
                )
                break
        for _ in progress(_urls_done(events, worker), total=num_urls, desc="fetch", unit="URLs"):
            pass
    except BaseException:
        worker.kill()
        raise
    finally:
        code = worker.close()
    if code != 0 and not worker.timed_out:
        last = worker.tail[-1] if worker.tail else "no output"
        tail = "\n".join(worker.tail)
        raise RuntimeError(f"img2dataset worker exited with code {code}: {last}\n--- output tail:\n{tail}")
    return {"num_shards_planned": planned, "timed_out": worker.timed_out}


def _urls_done(events, worker: WorkerRun):
    """One item per URL the worker reports done, so progress moves inside a big shard; failed shards are
    logged with why (img2dataset retries them, so a URL may count twice)."""
    for event in events:
        for _ in range(int(event.get("urls", 0))):
            yield None
        if "shard" in event and not event["ok"]:
            why = worker.tail[-1] if worker.tail else "no output"
            log.warning(
                "fetch: shard %s failed (%s); img2dataset retries it max_shard_retry times",
                event["shard"],
                why,
            )
