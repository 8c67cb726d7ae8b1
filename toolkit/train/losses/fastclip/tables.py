"""Per-sample FastCLIP state: one [N, C] table per node, shared by the node's local ranks.

The reference keeps a full fp32 replica of every table in every process (3.3 GB per process at 414M
samples). Here local rank 0 of each node creates the table in shared memory (a file under /dev/shm,
mapped with ``torch.from_file(shared=True)`` and unlinked once every local rank has mapped it), so a
node holds one copy however many GPUs it has.

Consistency: every node must see every update. After each step's all_gather of the updated rows, the
B gathered rows are split among the node's L local ranks: local rank r writes the rows that came from
global ranks k with k % L == r. Within a step the batch ids are disjoint, so writes never overlap; the
collectives order a step's reads (before the gather) after the previous step's writes (see
``FastCLIPLoss``). Without a process group, or with L = 1, the table is an ordinary CPU tensor.
"""

from __future__ import annotations

import os
import uuid

import torch
from torch import Tensor

from toolkit.core import dist as cdist

SHM_DIR = "/dev/shm"


def _node_layout(group=None) -> tuple[int, int, int, int]:
    """(rank, world, local_rank, local_world) from the process group and torchrun's env vars."""
    rank, k = cdist.get_rank(group), cdist.get_world_size(group)
    if k == 1:
        return 0, 1, 0, 1
    local_world, local_rank = cdist.get_local_world_size(), cdist.get_local_rank()
    if k % local_world != 0 or local_rank >= local_world:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={local_world} / LOCAL_RANK={local_rank} do not fit world size {k}"
        )
    return rank, k, local_rank, local_world


class SampleTables:
    """Named float columns over ``num_samples`` dense sample ids, stored row-major as [N, C].

    Created by every rank (collective when a process group exists: a broadcast of the shared-memory
    name and two barriers). ``columns`` maps name -> initial value.
    """

    def __init__(
        self,
        num_samples: int,
        columns: dict[str, float],
        dtype: torch.dtype = torch.float32,
        group=None,
        share: bool = True,
    ):
        if num_samples < 1:
            raise ValueError(f"data_size must be >= 1, got {num_samples}")
        self.names = list(columns)
        self.num_samples = num_samples
        self.group = group
        self.rank, self.world, self.local_rank, self.local_world = _node_layout(group)
        self.shared = share and self.world > 1 and self.local_world > 1
        init = torch.tensor([columns[n] for n in self.names], dtype=dtype)
        if self.shared:
            self.data = self._create_shared(init)
        else:
            self.data = init.repeat(num_samples, 1)

    def _create_shared(self, init: Tensor) -> Tensor:
        import torch.distributed as dist

        key = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(key, src=0, group=self.group)
        node = int(os.environ.get("GROUP_RANK", self.rank // self.local_world))
        path = os.path.join(SHM_DIR, f"cliptk-fastclip-{key[0]}-node{node}")
        size = self.num_samples * init.numel()
        if self.local_rank == 0:
            data = torch.from_file(path, shared=True, size=size, dtype=init.dtype).view(self.num_samples, -1)
            data.copy_(init.expand_as(data))
        dist.barrier(group=self.group)
        if self.local_rank != 0:
            data = torch.from_file(path, shared=True, size=size, dtype=init.dtype).view(self.num_samples, -1)
        dist.barrier(group=self.group)
        if self.local_rank == 0:
            os.unlink(path)  # the mappings stay valid; nothing is left behind if a rank dies
        return data

    def col(self, name: str) -> int:
        return self.names.index(name)

    def read(self, index: Tensor) -> Tensor:
        """Rows [b, C] (a copy) for sample ids ``index`` [b] (any device; read on CPU)."""
        return self.data.index_select(0, index.detach().to("cpu", torch.int64))

    def write_gathered(self, index: Tensor, rows: Tensor, local_batch: int) -> None:
        """Store the step's gathered rows [K·b, C] (rank order) for ids ``index`` [K·b]: this rank writes
        the rows of the global ranks assigned to it (all of them when it has no local peers)."""
        index = index.detach().to("cpu", torch.int64)
        rows = rows.detach().to("cpu", self.data.dtype)
        if self.shared:
            owner = torch.arange(index.shape[0]) // local_batch
            keep = (owner % self.local_world) == self.local_rank
            index, rows = index[keep], rows[keep]
        self.data.index_copy_(0, index, rows)

    def check_index(self, index: Tensor) -> None:
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.num_samples):
            raise IndexError(
                f"sample ids must lie in [0, {self.num_samples}) (data_size); got "
                f"min {int(index.min())}, max {int(index.max())}"
            )

    # ----------------------------------------------------------------- checkpoints
    def state(self) -> dict[str, Tensor]:
        """Column name -> [N] contiguous CPU copy (for state_dict / safetensors)."""
        return {n: self.data[:, i].clone() for i, n in enumerate(self.names)}

    def load(self, state: dict[str, Tensor], source: str = "state_dict") -> None:
        """Copy columns back; on a shared table only local rank 0 writes (the peers see its copy)."""
        for n in self.names:
            if n not in state:
                raise KeyError(f"{source}: missing FastCLIP table column {n!r}")
            if state[n].shape != (self.num_samples,):
                raise ValueError(
                    f"{source}: column {n!r} has shape {tuple(state[n].shape)}, expected "
                    f"({self.num_samples},) (data_size)"
                )
        if self.shared and self.local_rank != 0:
            return
        for i, n in enumerate(self.names):
            self.data[:, i].copy_(state[n])
