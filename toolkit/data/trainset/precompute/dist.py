"""``toolkit data precompute --nproc-per-node N [--nodes M --node-rank R --master-addr A]``: precompute's
ranks.

The job starts exactly like ``toolkit train``'s (:mod:`toolkit.core.launch`: torchrun on each node, or the
ranks ``srun`` started, or the user's own torchrun running ``python -m toolkit.data.trainset.precompute.rank
CONFIG.yaml``). Of K ranks, rank r processes the raw shards with index i = r (mod K) in sorted-URL order,
with its own process pool (``num_workers`` 0: this node's cores divided among its ranks) and frozen
towers, into the shared scratch folder (``tmp_dir``, or OUT/_tmp: it must be on a filesystem every node
sees, as OUT is). Each finished raw shard leaves a record there (:mod:`.resume`). Then every
rank's per-shard counts are gathered and rank 0 checks them against the records, assigns the ids once
over all raw shards (the same rule as one process: sorted URLs, sorted keys, first key wins) and writes the
training shards: the output is byte-identical to a one-process run's. Rank 0 keeps the stage books;
the launcher reports from OUT/manifest.json.

The collectives (gloo, whatever the device) carry only barriers and a few counts per raw shard.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from toolkit.core.launch import apply_slurm_env, is_worker, launch_job
from toolkit.core.stage import StageResult, read_manifest, settle_manifest

ENTRY = "toolkit.data.trainset.precompute.rank"  # what torchrun runs in each rank


@dataclass
class Ranks:
    """This process's place in a precompute job: rank of world (1 without a job), and its node's share of
    the cores. Every rank calls every method, in the same order."""

    rank: int = 0
    world: int = 1
    local_world: int = 1

    @classmethod
    def join(cls, launch) -> Ranks:
        """Join the job the environment describes (torchrun's or SLURM's variables); world 1 without one."""
        apply_slurm_env(launch)
        if not is_worker() or int(os.environ["WORLD_SIZE"]) == 1:
            return cls()
        from toolkit.core import dist

        info = dist.init_from_env(
            backend="gloo", timeout_s=launch.timeout_s
        )  # counts only: gloo on any device
        return cls(info.rank, info.world_size, max(1, info.local_world_size))

    def owns(self, index: int) -> bool:
        """True when raw shard ``index`` (in sorted-URL order) is this rank's to process."""
        return index % self.world == self.rank

    def barrier(self) -> None:
        if self.world > 1:
            from toolkit.core import dist

            dist.barrier()

    def gather_counts(self, counts: dict[int, int]) -> dict[int, int]:
        """Every rank's {raw shard index: samples read}, merged (on every rank)."""
        if self.world == 1:
            return dict(counts)
        import torch.distributed as tdist

        parts: list[dict[int, int] | None] = [None] * self.world
        tdist.all_gather_object(parts, counts)
        merged: dict[int, int] = {}
        for part in parts:
            merged.update(part or {})
        return merged

    def close(self) -> None:
        if self.world > 1:
            from toolkit.core import dist

            dist.destroy()


def tower_device() -> str:
    """Where this process runs frozen towers: its local rank's GPU when CUDA is there, else the CPU."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % torch.cuda.device_count()}"


def check_counts(gathered: dict[int, int], loaded: dict[int, int], urls: list[str], work: str) -> None:
    """Rank 0: the records it reads from the scratch folder must be the ones every rank reported."""
    missing = [urls[i] for i in sorted(gathered) if loaded.get(i) != gathered[i]]
    if missing:
        raise RuntimeError(
            f"precompute: rank 0 does not see what the other ranks processed in {work} (first: "
            f"{missing[0]}, {len(missing)} raw shard(s)): the scratch folder must be on a "
            "filesystem every node sees (set --set tmp_dir=DIR on shared storage)"
        )


def launch(cfg) -> StageResult:
    """The launcher: start the job's ranks through torchrun on this node and wait; node 0 reports rank 0's
    stage books, other nodes a summary."""
    try:
        launch_job(cfg.launch, cfg, ENTRY, "precompute")
    except BaseException as err:
        if cfg.launch.node_rank == 0:  # rank 0 may have died (or been stopped in a collective) mid-record
            settle_manifest(cfg.out, err)
        raise
    manifest = read_manifest(cfg.out) if cfg.launch.node_rank == 0 else None
    if manifest is None:  # another node: rank 0 (on node 0) writes the output and its manifest
        return StageResult(cfg.out, {"train": cfg.out}, {}, "", {}, "done")
    return StageResult(
        cfg.out,
        manifest.get("outputs", {}),
        manifest.get("counts", {}),
        manifest.get("config_hash", ""),
        manifest.get("details", {}),
        manifest.get("status", "done"),
    )


def wants_launch(cfg) -> bool:
    """True in the process the user started when the config asks for several processes (not in a rank
    that torchrun or ``srun`` started: SLURM's variables are applied first, as the trainer does)."""
    apply_slurm_env(cfg.launch)
    return cfg.launch.is_multiprocess and not is_worker()
