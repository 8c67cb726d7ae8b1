"""The sequence of global batches: a function of (dataset size, seed, global batch size) only.

Training reads a stream of *passes* over the N samples. Pass p is a pseudo-random permutation of the
sample ids, seeded by (seed, p); it is cut into ``N // B`` global batches of B consecutive positions and
its last ``N mod B`` positions are left out (a different random set every pass, so every batch holds B
distinct ids and no sample is favoured). Global batch t is batch ``t mod (N // B)`` of pass
``t // (N // B)``. Epochs (full passes, or virtual epochs of ``train_num_samples``) are ranges of t.

Rank r of K reads positions [r·B/K, (r+1)·B/K) of each global batch, so K ranks together see exactly
the batch one process would, and a resume at another world size or worker count continues at t.

The permutation is computed per position, never materialised (N can be 10^9): ids are grouped into
``block`` consecutive ids (block 1: samples shuffled individually; larger blocks give long sequential
reads for object stores), the full blocks are permuted by a 4-round Feistel network on [0, 4^k) with
cycle walking (a bijection of [0, num_blocks)), and the ids are rotated by a per-pass offset so the
short block at the end of the id space is a different set every pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from toolkit.core.seeds import GAMMA, splitmix64

_ROUNDS = 4


def _keys(seed: int, pass_index: int) -> np.ndarray:
    base = np.array([seed & 0xFFFFFFFF, pass_index & 0xFFFFFFFF], dtype=np.uint64)
    start = splitmix64(np.array([(int(base[0]) << 32) | int(base[1])], dtype=np.uint64))
    return splitmix64(start + np.arange(1, _ROUNDS + 2, dtype=np.uint64) * np.uint64(GAMMA))


def permute(values: np.ndarray, size: int, seed: int, pass_index: int) -> np.ndarray:
    """A bijection of [0, size) applied to ``values`` (int64 array), keyed by (seed, pass_index)."""
    if size <= 1:
        return values.astype(np.int64, copy=True)
    half_bits = max(1, (int(size - 1).bit_length() + 1) // 2)
    half_mask = np.uint64((1 << half_bits) - 1)
    keys = _keys(seed, pass_index)
    with np.errstate(over="ignore"):
        out = values.astype(np.uint64)
        todo = np.ones(out.shape, dtype=bool)
        while todo.any():  # cycle walking: re-apply until the value falls inside [0, size)
            v = out[todo]
            left, right = v >> np.uint64(half_bits), v & half_mask
            for r in range(_ROUNDS):
                left, right = right, left ^ (splitmix64(right ^ keys[r]) & half_mask)
            out[todo] = (left << np.uint64(half_bits)) | right
            todo = out >= np.uint64(size)
    return out.astype(np.int64)


@dataclass(frozen=True)
class BatchOrder:
    """The global-batch sequence of one training run (module docstring)."""

    num_samples: int
    batch_size: int
    seed: int = 0
    block: int = 1

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.block < 1:
            raise ValueError(f"batch_size and block must be >= 1, got {self.batch_size}, {self.block}")
        if self.num_samples < self.batch_size:
            raise ValueError(
                f"the global batch ({self.batch_size}) is larger than the dataset "
                f"({self.num_samples} samples): lower the batch size"
            )

    @property
    def batches_per_pass(self) -> int:
        return self.num_samples // self.batch_size

    @property
    def dropped_per_pass(self) -> int:
        """Positions of each pass left out by the drop rule (never repeated ids in a batch)."""
        return self.num_samples - self.batches_per_pass * self.batch_size

    def pass_ids(self, positions: np.ndarray, pass_index: int) -> np.ndarray:
        """Sample ids at ``positions`` (int64 array) of pass ``pass_index``."""
        n, k = self.num_samples, self.block
        full_blocks = n // k
        ids = positions.astype(np.int64, copy=True)
        in_full = positions < full_blocks * k
        q, r = np.divmod(positions[in_full], k)
        ids[in_full] = permute(q, full_blocks, self.seed, pass_index) * k + r
        shift = int(permute(np.array([0]), n, self.seed ^ 0x5DEECE66D, pass_index)[0]) if k > 1 else 0
        return (ids + shift) % n

    def batch_ids(self, t: int, rank: int = 0, world_size: int = 1) -> np.ndarray:
        """Sample ids of rank ``rank``'s slice of global batch ``t`` ([B/K] int64, in batch order)."""
        if self.batch_size % world_size:
            raise ValueError(
                f"the global batch ({self.batch_size}) must divide by the number of ranks ({world_size})"
            )
        local = self.batch_size // world_size
        pass_index, j = divmod(t, self.batches_per_pass)
        start = j * self.batch_size + rank * local
        return self.pass_ids(np.arange(start, start + local, dtype=np.int64), pass_index)
