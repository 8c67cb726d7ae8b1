"""A rank of a distributed precompute: ``python -m toolkit.data.trainset.precompute.rank CONFIG.yaml``.

torchrun (started by ``toolkit data precompute --nproc-per-node N``, or by the user) runs this in every
rank; :func:`toolkit.data.trainset.precompute.stage.run` then finds its rank (:mod:`.dist`).
"""

from __future__ import annotations

import os
import sys

from toolkit.core.log import get_logger


def main(argv: list[str] | None = None) -> None:
    """Run precompute as this rank with the config at ``argv[0]``; exits 1 with a one-line error."""
    from toolkit.core.agent import write_error_file
    from toolkit.core.config import build
    from toolkit.core.config_load import read_yaml
    from toolkit.core.log import setup_logging
    from toolkit.core.procs import SignalInterrupt, die_with_parent, exit_code, stop_on_signals
    from toolkit.data.trainset.precompute.stage import PrecomputeConfig, run

    if os.environ.get(
        "CLIPTK_AGENT_PID"
    ):  # started by cliptk's agent: never outlive it (a SIGKILLed launcher)
        die_with_parent(parent_pid=int(os.environ["CLIPTK_AGENT_PID"]))
    stop_on_signals()  # SIGTERM (the launcher's, or torchrun's after another rank failed) records interrupted
    argv = sys.argv[1:] if argv is None else argv
    setup_logging(
        os.environ.get("CLIPTK_LOG_LEVEL", "INFO") if os.environ.get("RANK", "0") == "0" else "WARNING"
    )
    try:
        run(build(PrecomputeConfig, read_yaml(argv[0]), source=argv[0]))
    except (Exception, SignalInterrupt) as err:  # one line per rank; torchrun reports the exit code
        get_logger("data.precompute").error(
            "rank %s: %s: %s", os.environ.get("RANK", "?"), type(err).__name__, err
        )
        # the rank's own error, timed: the launcher names the rank that failed first, not one that torchrun
        # stopped because of it (agent.first_failure)
        write_error_file(" ".join(f"{type(err).__name__}: {err}".split()))
        raise SystemExit(exit_code(err) if isinstance(err, SignalInterrupt) else 1) from err


if __name__ == "__main__":
    main()
