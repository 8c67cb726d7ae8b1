"""torchrun's elastic agent in a process of its own: ``python -m toolkit.core.agent RESULT.json ARGS...``.

Started by the launcher (``toolkit.core.launch.launch_job``), which supervises it (``supervise.Supervisor``).
Runs torchrun's ``main`` with ``ARGS`` and writes the outcome to ``RESULT.json`` for the launcher to report:
``{"ok": true}``, ``{"failed": "rank R exited with code C (...)"}`` (a worker failed beyond the restarts),
``{"signal": "SIGHUP"}`` (the agent itself got a signal it handles) or ``{"error": "Type: message"}``.
Exit code 0 for ok and signal, 1 otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from toolkit.core.log import QUIET_ENV  # "1": the user asked for --quiet; torch's loggers show errors only

AGENT_PID_ENV = "CLIPTK_AGENT_PID"  # set for the ranks: the agent they must not outlive


def write_error_file(message: str) -> None:
    """Called by a failing rank (``run.worker_main``): its one-line error, and when it failed to the
    microsecond, in the file torchrun reads back (``TORCHELASTIC_ERROR_FILE``), so that the launcher names
    this rank's own message, not "To enable traceback see", and can tell which rank failed first."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    try:
        with open(path, "w") as fh:
            json.dump({"message": message, "timestamp": int(now), "cliptk_time": now}, fh)
    except OSError:
        pass  # the exit code still reaches torchrun


def first_failure(err) -> str:
    """The first failure of a ChildFailedError, with its exit code and the rank's own message.

    A rank killed by a signal without an error of its own comes first (the others then fail in their
    collectives, a moment later, and the agent then signals them too: a rank that recorded an error with
    ``write_error_file`` before its SIGTERM is a consequence, which a loaded test run showed as
    "rank 0 exited with code -15" for a SIGKILLed rank 1), then the earliest failure recorded by a rank,
    then the lowest rank."""
    failures = getattr(err, "failures", {}) or {}

    def order(item):
        rank, failure = item
        data = getattr(failure, "error_file_data", None) or {}
        own = isinstance(data, dict) and "cliptk_time" in data
        when = data["cliptk_time"] if own else failure.timestamp
        return (0 if failure.exitcode < 0 and not own else 1, when, rank)

    for rank, failure in sorted(failures.items(), key=order):
        return f"rank {rank} exited with code {failure.exitcode} ({failure.message or 'see its log above'})"
    return str(err)


def main(argv: list[str]) -> int:
    result_path, args = argv[0], argv[1:]
    os.environ[AGENT_PID_ENV] = str(os.getpid())  # the ranks die with this process (train.run.worker_main)
    if os.environ.get(QUIET_ENV) == "1":
        logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(args)
        outcome = {"ok": True}
    except ChildFailedError as err:
        outcome = {"failed": first_failure(err)}
    except SignalException as err:  # torchrun passed the signal on: the ranks checkpoint and exit
        sigval = getattr(err, "sigval", None)
        outcome = {"signal": getattr(sigval, "name", str(sigval))}
    except Exception as err:  # noqa: BLE001 - reported by the launcher in one line
        outcome = {"error": f"{type(err).__name__}: {err}"}
    with open(result_path, "w") as fh:
        json.dump(outcome, fh)
    return 0 if ("ok" in outcome or "signal" in outcome) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
