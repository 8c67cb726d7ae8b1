"""The training loader: batches from precomputed training shards, split exactly across ranks and workers.

``make_loader(path, rank=, world_size=, epoch=, batch_size=, num_workers=)`` returns a torch
``DataLoader`` whose batches are dicts of tensors:

- ``image`` uint8 [b, H, W, 3] (RGB, not normalised) or ``image_features`` float16 [b, D_img];
- ``tokens`` int64 [b, L] or ``text_features`` float16 [b, D_txt];
- ``index`` int64 [b]: global sample ids (0..N-1), FastCLIP's per-sample state index;
- ``valid`` bool [b]: False only for padding copies (``last_batch='pad'``).

How an epoch is split (:func:`plan_epoch`, the same pure function on every rank and worker):
1. Shards are put in a per-epoch order (a permutation seeded by ``seed`` and ``epoch``) and their
   samples concatenated into one sequence of N positions.
2. Each rank takes one contiguous range of it: ``partial`` gives ranks N // W or N // W + 1 samples
   (every sample exactly once); ``drop`` gives each rank the same whole number of batches and
   leaves out the last N mod (W * b) positions of this epoch's order (a different set each epoch,
   reported as ``plan.num_dropped``); ``pad`` gives each rank the same whole number of batches by
   wrapping around to the start of the order, marking those copies ``valid=False``.
3. A rank's range is cut into batches and each DataLoader worker takes a contiguous run of whole
   batches, so only a rank's very last batch can be short (``partial`` only).
4. Workers seek straight to their first sample (samples have a fixed byte size), read the tar
   members (:mod:`toolkit.data.trainset.format`'s readers: directly, or with webdataset's tar
   iterator: ``reader``), shuffle within a buffer
   (seeded by seed, epoch, rank, worker) and batch.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from torch.utils.data import IterableDataset

from toolkit.data.trainset.format import Segment, TrainDataset, read_segment, read_segment_webdataset

LastBatch = Literal["partial", "drop", "pad"]
Reader = Literal["direct", "webdataset"]


@dataclass(frozen=True)
class RankPlan:
    """What one rank reads in one epoch: per-worker segments, batch and sample counts."""

    rank: int
    world_size: int
    epoch: int
    batch_size: int
    num_samples: int  # samples this rank yields, padding copies included
    num_batches: int
    num_dropped: int  # samples left out of this epoch across all ranks (last_batch='drop')
    num_padded: int  # padding copies this rank yields (last_batch='pad')
    workers: tuple[tuple[Segment, ...], ...]


def shard_order(num_shards: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """Per-epoch shard order, identical on every rank: a seeded permutation, or 0..S-1."""
    if not shuffle:
        return list(range(num_shards))
    return [int(i) for i in np.random.default_rng([seed, epoch]).permutation(num_shards)]


def _rank_range(n: int, rank: int, world: int, batch: int, last_batch: str) -> tuple[int, int, int]:
    """(first position, sample count, dropped in total) of ``rank`` in an epoch sequence of n samples."""
    if last_batch == "partial":
        lo, hi = rank * n // world, (rank + 1) * n // world
        return lo, hi - lo, 0
    if last_batch == "drop":
        per = n // (world * batch) * batch
        if per == 0:
            raise ValueError(f"last_batch='drop': {n} samples are fewer than one global batch of "
                             f"{world} ranks x {batch}; use 'partial' or 'pad'")
        return rank * per, per, n - world * per
    if last_batch == "pad":
        per = -(-n // (world * batch)) * batch
        return rank * per, per, 0
    raise ValueError(f"unknown last_batch {last_batch!r}; use partial, drop or pad")


def _segments(order: list[int], sizes: list[int], lo: int, hi: int) -> list[Segment]:
    """Positions [lo, hi) of the epoch sequence (wrapping past its end) as shard segments."""
    cum = [0]
    for j in order:
        cum.append(cum[-1] + sizes[j])
    n, out, p = cum[-1], [], lo
    while p < hi:
        wrap, q = divmod(p, n)
        j = bisect.bisect_right(cum, q) - 1
        take = min(cum[j + 1] - q, hi - p)
        out.append(Segment(order[j], q - cum[j], take, wrap == 0))
        p += take
    return out


def plan_epoch(ds: TrainDataset, *, rank: int, world_size: int, epoch: int, batch_size: int, num_workers: int,
               seed: int = 0, shuffle: bool = True, last_batch: LastBatch = "partial") -> RankPlan:
    """The deterministic split of one epoch for ``rank`` (see module docstring); pure, called by every
    rank and every DataLoader worker. ``num_workers`` 0 means reading in the main process (one stream)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    streams = max(1, num_workers)
    sizes = [s.num_samples for s in ds.shards]
    order = shard_order(len(sizes), epoch, seed, shuffle)
    lo, count, dropped = _rank_range(ds.num_samples, rank, world_size, batch_size, last_batch)
    num_batches = -(-count // batch_size)
    workers = []
    for w in range(streams):
        b0, b1 = w * num_batches // streams, (w + 1) * num_batches // streams
        start, stop = lo + b0 * batch_size, min(lo + b1 * batch_size, lo + count)
        workers.append(tuple(_segments(order, sizes, start, stop)) if stop > start else ())
    padded = sum(s.count for segs in workers for s in segs if not s.valid)
    return RankPlan(rank, world_size, epoch, batch_size, count, num_batches, dropped, padded, tuple(workers))


def _shuffled(samples: Iterator[dict], buffer: int, rng: random.Random) -> Iterator[dict]:
    """Reservoir-style shuffle within ``buffer`` samples (no sample is lost or repeated)."""
    pool: list[dict] = []
    for sample in samples:
        if len(pool) < buffer:
            pool.append(sample)
            continue
        j = rng.randrange(len(pool))
        yield pool[j]
        pool[j] = sample
    rng.shuffle(pool)
    yield from pool


def collate(samples: list[dict], roles: list[str]) -> dict[str, Any]:
    """List of sample dicts -> batch of tensors (see module docstring for keys, dtypes, shapes)."""
    import torch
    from torch.utils.data import get_worker_info

    shared = get_worker_info() is not None  # stack straight into shared memory: one copy fewer per batch
    batch = {}
    for role in roles:
        first = samples[0][role]
        dtype = np.dtype(np.int64) if role == "tokens" else first.dtype.newbyteorder("=")
        out = torch.empty((len(samples), *first.shape), dtype=torch.from_numpy(np.zeros(0, dtype)).dtype)
        if shared:
            out.share_memory_()
        np.stack([s[role] for s in samples], out=out.numpy(), casting="same_kind")
        batch[role] = out
    batch["index"] = torch.tensor([s["index"] for s in samples], dtype=torch.int64)
    batch["valid"] = torch.tensor([s["valid"] for s in samples], dtype=torch.bool)
    return batch


def _batched(samples: Iterator[dict], batch_size: int, roles: list[str], skip: int = 0) -> Iterator[dict]:
    """Collate consecutive samples into batches; the first ``skip`` batches are formed but not collated."""
    chunk: list[dict] = []
    for sample in samples:
        chunk.append(sample)
        if len(chunk) == batch_size:
            if skip:
                skip -= 1
            else:
                yield collate(chunk, roles)
            chunk = []
    if chunk and not skip:
        yield collate(chunk, roles)


def resume_point(plan: RankPlan, start_batch: int) -> tuple[list[int], int]:
    """(batches each worker has already yielded, next worker to ask) after the rank's first
    ``start_batch`` batches: the DataLoader takes batches from its workers round-robin starting at
    worker 0 and passes over finished ones, so a resumed loader rotates worker roles by the second value."""
    left = [-(-sum(s.count for s in segs) // plan.batch_size) for segs in plan.workers]
    skips, w = [0] * len(left), 0
    for _ in range(min(start_batch, sum(left))):
        while left[w] == 0:
            w = (w + 1) % len(left)
        skips[w] += 1
        left[w] -= 1
        w = (w + 1) % len(left)
    return skips, w


class TrainStream(IterableDataset):
    """IterableDataset of batches for one rank and epoch; each DataLoader worker reads its own plan part."""

    def __init__(self, ds: TrainDataset, *, rank: int, world_size: int, epoch: int, batch_size: int,
                 num_workers: int, seed: int = 0, shuffle: bool = True, shuffle_buffer: int = 1000,
                 last_batch: LastBatch = "partial", reader: Reader = "direct", start_batch: int = 0):
        super().__init__()
        if start_batch < 0:
            raise ValueError(f"start_batch must be >= 0, got {start_batch}")
        if reader not in ("direct", "webdataset"):
            raise ValueError(f"unknown reader {reader!r}; use direct or webdataset")
        self.ds, self.seed, self.shuffle, self.shuffle_buffer = ds, seed, shuffle, shuffle_buffer
        self.reader, self.start_batch = reader, start_batch
        self.args = dict(rank=rank, world_size=world_size, epoch=epoch, batch_size=batch_size, seed=seed,
                         shuffle=shuffle, last_batch=last_batch)
        self.plan = plan_epoch(ds, num_workers=num_workers, **self.args)

    def __len__(self) -> int:
        return max(0, self.plan.num_batches - self.start_batch)

    def __iter__(self) -> Iterator[dict]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker, streams = (info.id, info.num_workers) if info is not None else (0, 1)
        plan = plan_epoch(self.ds, num_workers=streams, **self.args)
        skips, pointer = resume_point(plan, self.start_batch)
        worker = (worker + pointer) % streams  # this process plays that worker of the uninterrupted epoch
        segments = list(plan.workers[worker])
        rng = random.Random(f"{self.seed}-{plan.epoch}-{plan.rank}-{worker}")
        roles = [f.role for f in self.ds.fields]
        read = read_segment if self.reader == "direct" else read_segment_webdataset
        samples = (s for seg in segments for s in read(self.ds, seg))
        if self.shuffle and self.shuffle_buffer > 1:
            samples = _shuffled(samples, self.shuffle_buffer, rng)
        yield from _batched(samples, plan.batch_size, roles, skips[worker])


def make_loader(path: str | TrainDataset, *, rank: int = 0, world_size: int = 1, epoch: int = 0, batch_size: int,
                num_workers: int = 0, seed: int = 0, shuffle: bool = True, shuffle_buffer: int = 1000,
                last_batch: LastBatch = "partial", reader: Reader = "direct", start_batch: int = 0,
                pin_memory: bool = False, prefetch_factor: int = 2):
    """DataLoader over the training shards at ``path`` (local or fsspec) for one rank and epoch.

    Called by every rank once per epoch. ``len(loader)`` and ``loader.dataset.plan`` give this rank's
    batch count (equal on all ranks for 'drop' and 'pad'; may differ by one for 'partial').
    ``start_batch`` resumes mid-epoch: the loader yields exactly the batches a full pass with the same
    arguments yields from position ``start_batch`` on (skipped samples are read but not collated).
    """
    from torch.utils.data import DataLoader

    ds = path if isinstance(path, TrainDataset) else TrainDataset.open(str(path))
    stream = TrainStream(ds, rank=rank, world_size=world_size, epoch=epoch, batch_size=batch_size,
                         num_workers=num_workers, seed=seed, shuffle=shuffle, shuffle_buffer=shuffle_buffer,
                         last_batch=last_batch, reader=reader, start_batch=start_batch)
    extra = {"prefetch_factor": prefetch_factor} if num_workers > 0 else {}
    return DataLoader(stream, batch_size=None, num_workers=num_workers, pin_memory=pin_memory, **extra)
