"""Rank side of test_fsdp.py: every sharded run of one world size inside one gloo job (imported by bare name).

``python fsdp_jobs.py OUT_DIR`` under ``_launch.run_rank_script``: reads OUT_DIR/jobs.json ({"data": the
training folder, "runs": {name: TrainConfig overrides}}), trains each run with ``loop.train`` in this job's
process group (``Runtime.start`` finds the group there), each into OUT_DIR/name, and saves {name: its summary}
per rank. One job per world size instead of one launch per run: the ranks' start-up (imports, rendezvous) was
most of each run's time on 2 shared cores.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from _launch import rank_main
from trainkit import train_cfg


def _runs(world: int, k: int, rank: int) -> dict:
    from toolkit.train.loop import train

    out = Path(sys.argv[1])
    jobs = json.loads((out / "jobs.json").read_text())
    return {name: train(train_cfg(jobs["data"], out / name, **over)) for name, over in jobs["runs"].items()}


if __name__ == "__main__":
    torch.set_num_threads(1)
    rank_main(_runs, sys.argv[1])
