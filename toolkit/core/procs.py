"""Child-process hygiene: SIGTERM and SIGHUP stop a command like Ctrl-C, and children die with their parent.

- :func:`stop_on_signals` (installed by the ``toolkit`` command) makes SIGTERM and SIGHUP raise
  :class:`SignalInterrupt`, a ``KeyboardInterrupt``, in the process that installed it. Every stage already
  turns Ctrl-C into a clean stop (manifest "interrupted", output lock released, its process groups
  killed: fetch's download worker, a shell stage's command, precompute's pool), so the other stop signals
  take the very same path instead of killing the process on the spot and orphaning its children. A
  process forked from it (a pool worker) inherits the handler but not the role: there the signal does
  what it would by default (the worker ends quietly, without a traceback).
- :func:`die_with_parent` asks Linux to SIGKILL the calling process when its parent dies
  (``PR_SET_PDEATHSIG``), even when the parent is SIGKILLed and can clean up nothing. Children call it
  first thing (a ``preexec_fn`` or a pool initializer).
- :class:`GroupReaper` kills a child's whole process group when this process dies, even by SIGKILL: the
  grandchildren that ``PR_SET_PDEATHSIG`` cannot reach (img2dataset's pool, a shell command's ``sleep``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# The signals that stop a command like Ctrl-C does (SIGINT keeps Python's own KeyboardInterrupt).
STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))
_installed_by: int | None = None  # pid of the process whose handler raises; forks fall back to the default


class SignalInterrupt(KeyboardInterrupt):
    """SIGTERM or SIGHUP asked this command to stop; handled wherever Ctrl-C is. ``signum`` is the signal."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(
            f"interrupted by {signal.Signals(signum).name}; finished work is kept, rerun the same "
            "command to resume"
        )


def _raise(signum: int, frame) -> None:
    if os.getpid() != _installed_by:  # a forked child (pool worker): end as the signal would by default
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise SignalInterrupt(signum)


def stop_on_signals() -> None:
    """Make SIGTERM and SIGHUP raise :class:`SignalInterrupt` in this process (main thread only).

    Handlers that a stage installs for its own run (the trainer's preemption flag, the launcher's
    supervisor) replace these while they run and put them back after."""
    global _installed_by
    _installed_by = os.getpid()
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise)


def exit_code(err: BaseException) -> int:
    """The shell's code for a command stopped by ``err``: 128 + the signal (130 for Ctrl-C)."""
    return 128 + getattr(err, "signum", signal.SIGINT)


def die_with_parent(sig: int = signal.SIGKILL, parent_pid: int | None = None) -> None:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux; a no-op elsewhere).

    ``parent_pid``: the parent that must be alive; if it already died before the call (the request would
    then never fire), this process exits at once."""
    if not sys.platform.startswith("linux"):
        return
    libc = _libc()
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def child_preexec(parent_pid: int | None = None):
    """A ``subprocess.Popen(preexec_fn=...)`` that makes the child die with ``parent_pid`` (default: this
    process). libc is loaded here, in the parent: the child between fork and exec should only call it."""
    parent_pid = os.getpid() if parent_pid is None else parent_pid
    if sys.platform.startswith("linux"):
        _libc()
    return lambda: die_with_parent(signal.SIGKILL, parent_pid)


# The reaper's whole program: wait for EOF on stdin (the parent's end closes when the parent exits, however it
# exits); unless the parent wrote "keep" first, SIGKILL the process group named by argv[1].
_REAPER = (
    "import os, signal, sys\n"
    "if sys.stdin.buffer.read() != b'keep':\n"
    "    try:\n        os.killpg(int(sys.argv[1]), signal.SIGKILL)\n"
    "    except OSError:\n        pass\n"
)


class GroupReaper:
    """Kills process group ``pgid`` when this process dies, even by SIGKILL.

    ``PR_SET_PDEATHSIG`` reaches only a direct child: the processes *it* starts (img2dataset's spawn pool and
    resource tracker under the fetch worker, a shell stage's ``sleep 1000`` under bash) are re-parented to
    init and run on. So a small reaper process, in a session of its own, holds the read end of a pipe whose
    write end only this process holds; the kernel closes it when this process exits, the reaper reads EOF
    and SIGKILLs the group. ``release()`` (a normal end) tells it to leave the group alone: background
    processes a command started on purpose live on, as before. Called by the process that started the group.
    """

    def __init__(self, pgid: int):
        read_fd, self._write_fd = os.pipe()  # not inheritable: no other child holds the write end
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _REAPER, str(pgid)],
                stdin=read_fd,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            os.close(read_fd)

    def release(self) -> None:
        """The group ended normally: the reaper exits without killing anything."""
        self._close(b"keep")

    def kill_now(self) -> None:
        """Kill the group now (and end the reaper)."""
        self._close(b"")

    def _close(self, message: bytes) -> None:
        if self._write_fd < 0:
            return
        try:
            if message:
                os.write(self._write_fd, message)
        finally:
            os.close(self._write_fd)
            self._write_fd = -1
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


_LIBC: list = []


def _libc():
    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]
