"""Launch plumbing shared by the multi-process gloo tests (losses/test_modes via _dist_jobs, losses/test_fastclip_dist).

Imported by file location (tests/train on sys.path): the venv ships an unrelated top-level ``tests`` package.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the rendezvous port of one job)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, local_world: int | None = None) -> dict[str, str]:
    """torchrun's variables for ``rank`` of ``world`` on 127.0.0.1:``port``, with ``local_world`` ranks per
    node (default: one node holding every rank)."""
    local_world = world if local_world is None else local_world
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "LOCAL_RANK": str(rank % local_world), "LOCAL_WORLD_SIZE": str(local_world),
            "GROUP_RANK": str(rank // local_world)}
