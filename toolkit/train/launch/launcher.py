"""Starting training processes: the generic launcher (toolkit.core.launch: torchrun, SLURM) with the
trainer's config; the names below are re-exported for the trainer's modules and tests."""

from __future__ import annotations

from toolkit.core.launch import (  # noqa: F401 - the trainer's launch API
    AGENT_SIGNALS,
    WORKER_ENV,
    RendezvousError,
    _slurm_hosts,
    apply_slurm_env,
    check_port,
    describe_wait,
    is_worker,
    launch_job,
    launched_by_cliptk,
    rendezvous_kind,
    torchrun_argv,
    warn_unused_port,
)
from toolkit.train.config import TrainConfig


def launch(cfg: TrainConfig, entry: str) -> None:
    """Run the training job's processes on this node (toolkit.core.launch.launch_job)."""
    launch_job(cfg.launch, cfg, entry, "training")
