"""torchrun's elastic agent in a process of its own: ``python -m toolkit.train.agent RESULT.json ARGS...``.

Started by the launcher (``launch.launch``), which supervises it (``supervise.Supervisor``). Runs
torchrun's ``main`` with ``ARGS`` and writes the outcome to ``RESULT.json`` for the launcher to report:
``{"ok": true}``, ``{"failed": "rank R exited with code C (...)"}`` (a worker failed beyond the restarts),
``{"signal": "SIGHUP"}`` (the agent itself got a signal it handles) or ``{"error": "Type: message"}``.
Exit code 0 for ok and signal, 1 otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from toolkit.core.log import QUIET_ENV  # "1": the user asked for --quiet; torch's loggers show errors only

AGENT_PID_ENV = "CLIPTK_AGENT_PID"  # set for the ranks: the agent they must not outlive


def first_failure(err) -> str:
    """The lowest failed rank of a ChildFailedError, with its exit code and message."""
    failures = getattr(err, "failures", {}) or {}
    for rank, failure in sorted(failures.items()):
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
