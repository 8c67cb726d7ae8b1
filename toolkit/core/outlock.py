"""One run per output folder: an advisory ``flock`` on ``OUT/.lock``, held while a stage runs.

Two runs writing into the same folder interleave shards, manifests and logs and both report success, so
:func:`toolkit.core.stage.stage_run` takes this lock before it writes anything, and a second run fails at
once with :class:`OutputLocked`, naming the holder (pid, host, start time, command line: the lock file's
content). The operating system releases a ``flock`` when its holder exits, however it exits (``kill -9``
included), so a lock file left behind never blocks a later run: the file's presence means nothing, only
the lock does. Processes that inherit the descriptor (a fetch worker, a forked pool) hold the lock with
their parent, so a folder stays locked until the last process writing into it is gone.

Only local folders are locked. Object stores and other fsspec file systems have no such lock: two runs
into the same remote output are not detected.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from toolkit.core import files

LOCK_FILE = ".lock"
# Bytes of the lock file read back to name the holder (pid, host, time, command line; a long command is cut).
MAX_HOLDER_BYTES = 4096


class OutputLocked(RuntimeError):
    """Another run holds the output folder's lock."""


def _holder_info() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        # one line whatever the arguments hold (python -c scripts span lines): errors stay one line
        "command": " ".join(" ".join(getattr(sys, "orig_argv", sys.argv)).split())[: MAX_HOLDER_BYTES // 2],
    }


def describe_holder(fd: int) -> str:
    """'pid 12 on host, since 2024-..., running: toolkit data fetch ...' from the lock file's content."""
    raw = os.pread(fd, MAX_HOLDER_BYTES, 0)
    try:
        info = json.loads(raw)
    except ValueError:
        return "a run that has not written its details yet" if not raw.strip() else "an unknown run"
    return (
        f"pid {info.get('pid')} on {info.get('host')}, since {info.get('started_at')}, "
        f"running: {info.get('command')}"
    )


@contextmanager
def output_lock(out: str) -> Iterator[int | None]:
    """Hold the exclusive lock of local folder ``out`` (created if missing) while the block runs.

    Yields the lock file's descriptor (None for remote folders, which are not locked) so that a child
    process can inherit it (``subprocess.Popen(pass_fds=...)``). Raises :class:`OutputLocked` at once if
    another process holds it.
    """
    if not files.is_local(out):
        yield None
        return
    path = os.path.join(files.local_path(out), LOCK_FILE)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # never truncated before the lock is ours
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputLocked(
                f"{out} is in use by another run ({describe_holder(fd)}); wait for it to finish "
                "or choose another output folder"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_holder_info()) + "\n").encode(), 0)
        try:
            yield fd
        finally:
            os.ftruncate(fd, 0)  # no holder any more: the next run names nobody stale
    finally:
        os.close(fd)  # releases the lock (children that inherited the descriptor keep it until they exit)
