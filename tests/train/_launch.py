"""Launch plumbing shared by the multi-process gloo tests (losses/test_modes via _dist_jobs, the objectives'
losses/test_*_dist.py).

Imported by file location (tests/train on sys.path): the venv ships an unrelated top-level ``tests`` package.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the rendezvous port of one job)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, local_world: int | None = None) -> dict[str, str]:
    """torchrun's variables for ``rank`` of ``world`` on 127.0.0.1:``port``, with ``local_world`` ranks per
    node (default: one node holding every rank)."""
    local_world = world if local_world is None else local_world
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "LOCAL_RANK": str(rank % local_world),
        "LOCAL_WORLD_SIZE": str(local_world),
        "GROUP_RANK": str(rank // local_world),
    }


def run_rank_script(
    script: str, num_ranks: int, out_dir: Path, *, local_world: int | None = None, timeout_s: float = 240
) -> list[Any]:
    """Start test module ``script`` as ``num_ranks`` gloo ranks on 127.0.0.1 (``python script OUT_DIR``, each
    rank writing ``OUT_DIR/rank{r}.pt``) and return what every rank wrote, in rank order. A rank that fails
    fails the test with the end of its log; one that hangs past ``timeout_s`` is killed, as are the others."""
    import torch

    port, root = free_port(), Path(script).resolve().parents[3]
    helpers = Path(__file__).resolve().parent  # tests/train: this module and the oracles
    procs = []
    for rank in range(num_ranks):
        env = dict(
            os.environ,
            **rank_env(rank, num_ranks, port, local_world),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(root), str(helpers), os.environ.get("PYTHONPATH", "")]),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, script, str(out_dir)],
                env=env,
                cwd=root,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        logs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:  # a hung rank must not outlive the test
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {rank} failed:\n{log[-4000:]}"
    return [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(num_ranks)]


def rank_main(run: Any, out_dir: str) -> None:
    """The rank side of :func:`run_rank_script`: join the gloo group torchrun's variables describe, save
    ``run(world, world, rank)`` to ``OUT_DIR/rank{r}.pt``, and leave the group once every rank has saved."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    rank, k = dist.get_rank(), dist.get_world_size()
    torch.save(run(k, k, rank), Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
