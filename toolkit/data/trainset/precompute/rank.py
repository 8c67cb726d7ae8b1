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
    from toolkit.core.config import build, read_yaml
    from toolkit.core.log import setup_logging
    from toolkit.data.trainset.precompute.stage import PrecomputeConfig, run

    argv = sys.argv[1:] if argv is None else argv
    setup_logging(os.environ.get("CLIPTK_LOG_LEVEL", "INFO") if os.environ.get("RANK", "0") == "0" else "WARNING")
    try:
        run(build(PrecomputeConfig, read_yaml(argv[0]), source=argv[0]))
    except Exception as err:  # one line per rank; torchrun reports the exit code
        get_logger("data.precompute").error("rank %s: %s: %s", os.environ.get("RANK", "?"), type(err).__name__, err)
        raise SystemExit(1) from err


if __name__ == "__main__":
    main()
