"""The training loader: this rank's slice of every global batch, in an order no world size changes.

``make_loader(path, batch_size=B, rank=r, world_size=K, seed=, start_step=, num_steps=)`` returns a torch
``DataLoader`` whose items are this rank's slices of global batches t = start_step, start_step+1, ...
(``toolkit.data.trainset.order``: a pseudo-random permutation per pass over the dataset, seeded by
``seed``; each pass cut into ``N // B`` batches). Each item is a dict:

- ``image`` uint8 [B/K, H, W, 3] (RGB, not normalised) or ``image_features`` float16 [B/K, D_img];
- ``tokens`` int64 [B/K, L] or ``text_features`` float16 [B/K, D_txt];
- ``ref_image``, ``ref_text`` float16 [B/K, D_ref]: a reference model's normalised embeddings, in sets
  precomputed with ``--reference-model`` (:mod:`.reference`), rows in ``index`` order;
- ``index`` int64 [B/K]: global sample ids (0..N-1), FastCLIP's per-sample state index;
- ``crop_box`` int64 [B/K, 4] (left, top, width, height), only with a ``toolkit.data.augment.DeviceCrop``
  transform: ``image`` is then the stored pixels, cropped and resized later on the training device;
- ``step``: the global batch index t.

K ranks together read exactly the global batches one process would, so training with K ranks equals
training with one on the same global batch, and a resume at any world size or worker count continues at
the next t. DataLoader worker w of W reads batches t ≡ start_step + w (mod W) and the DataLoader takes
them round-robin, so batches arrive in t order. jpeg and index sets (``refs``) read each image's bytes through
their table and decode them in the worker; pixels sets are read by seeking (fixed-size samples): the ids
of a slice are sorted, grouped into runs of consecutive ids per shard, and each run is one read call,
on a local disk straight into the rows its samples take in the batch (:mod:`.scatter`, one copy per
byte); ``block`` > 1 makes runs long (sequential reads for object stores). ``shuffle=False`` reads every id
once, in order, on one process (``InOrder``), for inspection and tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset

from toolkit.core import files
from toolkit.data.trainset import integrity
from toolkit.data.trainset import scatter as scatter_reads
from toolkit.data.trainset.format import TrainDataset, decode_rows, open_shard, read_rows_into
from toolkit.data.trainset.order import BatchOrder

# Open shard files a worker keeps (a global order touches every shard; reopening costs a round trip on
# object stores). 64 handles stay well under the usual 1024 open-files limit with several workers.
MAX_OPEN_FILES = 64


class SampleReader:
    """Reads arbitrary sample ids of one dataset into stacked arrays; keeps shard files open (one per
    process: each DataLoader worker makes its own)."""

    def __init__(self, ds: TrainDataset, vocab_size: int | None = None, scatter: bool | None = None):
        """``scatter``: read each run straight into batch order (:mod:`.scatter`, local files only); None:
        when the dataset lies on a local file system and the platform has ``os.preadv``."""
        self.ds, self.vocab_size = ds, vocab_size
        self.first_ids = np.array([s.first_id for s in ds.shards], dtype=np.int64)
        self._open: dict[int, Any] = {}
        self._sums: dict[int, list[int] | None] = {}
        self._raw: np.ndarray | None = None
        if scatter is None:
            scatter = files.is_local(ds.root) and scatter_reads.available()
        self._scatter = scatter_reads.ScatterReads(ds) if scatter else None

    def _shard_sums(self, shard: int) -> list[int] | None:
        if shard not in self._sums:  # 8 bytes a sample: kept for every shard this process touched
            self._sums[shard] = integrity.load_sums(self.ds, shard)
        return self._sums[shard]

    def _file(self, shard: int):
        if shard not in self._open:
            if len(self._open) >= MAX_OPEN_FILES:
                oldest = next(iter(self._open))
                self._open.pop(oldest).close()
            self._open[shard] = open_shard(self.ds, shard)
            if self._scatter is not None:
                scatter_reads.check_size(self.ds, shard, self._open[shard])
            self._shard_sums(shard)
        return self._open[shard]

    def read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """{role: C-contiguous array [len(ids), *shape]} for ``ids`` (int64, any order, in that order).

        The ids are read in sorted order, a run of consecutive ids per read call. Local files: each run
        straight into the rows its samples take in the batch (:mod:`.scatter`: preadv, one copy per
        byte). Otherwise into one reused raw buffer (readinto, so no fresh 150 kB buffer is allocated and
        page-faulted per sample), each run verified while in cache, then gathered into batch order: a
        second copy, per field."""
        if ids.size and (ids.min() < 0 or ids.max() >= self.ds.num_samples):
            raise IndexError(f"{self.ds.root}: sample ids must lie in [0, {self.ds.num_samples}), got "
                             f"{int(ids.min())}..{int(ids.max())}")
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        shards = np.searchsorted(self.first_ids, sorted_ids, side="right") - 1
        breaks = np.flatnonzero((np.diff(sorted_ids) != 1) | (np.diff(shards) != 0)) + 1
        if self._scatter is not None:
            rows, starts, cuts = order.tolist(), (sorted_ids - self.first_ids[shards]).tolist(), breaks.tolist()
            shard_of = shards.tolist()  # Python ints: numpy scalars cost ~10x more per run (one run a sample)
            runs = [(shard_of[lo], starts[lo], rows[lo:hi])
                    for lo, hi in zip([0, *cuts], [*cuts, len(rows)], strict=True) if hi > lo]
            out = self._scatter.read(runs, self._file, self._shard_sums)
        else:
            out = self._read_runs(ids, order, sorted_ids, shards, breaks)
        if "tokens" in out:  # once per batch: shuffled ids make runs of ~1 sample, too short to vectorise
            integrity.check_batch_tokens(self.ds, ids, out["tokens"], self.vocab_size)
        return out

    def _read_runs(self, ids: np.ndarray, order: np.ndarray, sorted_ids: np.ndarray, shards: np.ndarray,
                   breaks: np.ndarray) -> dict[str, np.ndarray]:
        raw = self._raw_buffer(len(ids))
        for lo, hi in zip(np.r_[0, breaks], np.r_[breaks, len(ids)], strict=True):
            shard = int(shards[lo])
            start = int(sorted_ids[lo] - self.first_ids[shard])
            read_rows_into(self._file(shard), self.ds, shard, start, raw[lo:hi], self._sums[shard])
        inverse = np.empty_like(order)
        inverse[order] = np.arange(len(ids))
        return {role: values[inverse] for role, values in decode_rows(self.ds, raw).items()}

    def _raw_buffer(self, n: int) -> np.ndarray:
        if self._raw is None or self._raw.shape[0] < n:
            self._raw = np.empty((n, self.ds.sample_bytes), np.uint8)
        return self._raw[:n]

    def close(self) -> None:
        for fh in self._open.values():
            fh.close()
        self._open.clear()


def make_reader(ds: TrainDataset, vocab_size: int | None = None):
    """The sample reader of ``ds``'s storage mode: :class:`SampleReader` (pixels) or
    :class:`toolkit.data.trainset.refs.RefReader` (jpeg, index: decodes in the loader's workers)."""
    if ds.storage == "pixels":
        return SampleReader(ds, vocab_size)
    from toolkit.data.trainset.refs import RefReader

    return RefReader(ds, vocab_size, MAX_OPEN_FILES)


class WorkerFailure:
    """An exception raised in a DataLoader worker, sent to the main process as an item so that
    :class:`TrainLoader` raises it there as itself: torch would re-raise it as a 40-line "Caught ValueError in
    DataLoader worker process 0" message wrapping the one line that says what is wrong."""

    def __init__(self, err: Exception, worker: int):
        import traceback

        self.exc_type, self.message, self.worker = type(err), str(err), worker
        self.trace = "".join(traceback.format_exception(err))

    def error(self) -> Exception:
        try:
            err = self.exc_type(self.message)
        except Exception:  # noqa: BLE001 - an exception type whose constructor wants other arguments
            err = RuntimeError(f"{self.exc_type.__name__}: {self.message}")
        err.add_note(f"(raised in DataLoader worker {self.worker}:\n{self.trace})")
        return err


class InOrder(BatchOrder):
    """``shuffle=False``: one process reads ids 0..N-1 in order, every sample once (the last batch may be
    short); for inspection and tests, not training (a short batch would not split over ranks)."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    @property
    def batches_per_pass(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def batch_ids(self, t: int, rank: int = 0, world_size: int = 1) -> np.ndarray:
        if world_size != 1:
            raise ValueError("shuffle=False reads the dataset in order on one process (world_size 1)")
        start = (t % self.batches_per_pass) * self.batch_size
        return np.arange(start, min(start + self.batch_size, self.num_samples), dtype=np.int64)


def to_tensors(arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """numpy fields -> torch tensors; token ids become int64 (what open_clip's text towers index with)."""
    import torch

    return {role: torch.from_numpy(a.astype(np.int64) if role == "tokens" else a) for role, a in arrays.items()}


class GlobalBatchStream(IterableDataset):
    """This rank's slices of global batches [start_step, start_step + num_steps) (module docstring)."""

    def __init__(self, ds: TrainDataset, order: BatchOrder, *, rank: int, world_size: int, start_step: int,
                 num_steps: int, image_transform=None):
        super().__init__()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        order.batch_ids(start_step, rank, world_size)  # refuses a batch that does not divide by the ranks
        self.ds, self.order, self.rank, self.world_size = ds, order, rank, world_size
        self.start_step, self.num_steps = start_step, num_steps
        # (images uint8 [b, H, W, 3], ids [b], step) -> tensor [b, S, S, 3]: crops (toolkit.data.augment), or
        # a dict of fields: the stored pixels and crop boxes [b, 4] for the device to crop (DeviceCrop)
        self.image_transform = image_transform
        self.vocab_size = integrity.vocab_size(ds)  # resolved here, once, not in every worker
        if not all(s.sums for s in ds.shards):
            integrity.notice_unverified(ds)  # here, so that forked workers do not repeat it

    def __len__(self) -> int:
        return self.num_steps

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import torch
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        reader = make_reader(self.ds, self.vocab_size)
        try:
            for t in range(self.start_step + worker, self.start_step + self.num_steps, num_workers):
                ids = self.order.batch_ids(t, self.rank, self.world_size)
                arrays = _read_batch(reader, self.ds, ids, t)
                image = arrays.pop("image") if self.image_transform is not None and "image" in arrays else None
                batch = to_tensors(arrays)
                if image is not None:
                    made = self.image_transform(image, ids, t)  # a tensor, or fields (DeviceCrop: + crop_box)
                    batch.update(made if isinstance(made, dict) else {"image": made})
                batch["index"], batch["step"] = torch.from_numpy(ids), t
                yield batch
        except Exception as err:
            if info is None:
                raise
            yield WorkerFailure(err, worker)  # in batch order: the main process raises it at step t
        finally:
            reader.close()


def _read_batch(reader: Any, ds: TrainDataset, ids: np.ndarray, step: int) -> dict[str, np.ndarray]:
    """``reader.read(ids)``; a server that stopped answering mid-run is named with the batch being read (the
    HTTP client says only "Cannot connect to host", fsspec's http "FileNotFoundError")."""
    try:
        return reader.read(ids)
    except Exception as err:
        first = ", ".join(str(i) for i in ids[:3].tolist()) + (", ..." if len(ids) > 3 else "")
        where = f"the batch of step {step}: samples {first}"
        if isinstance(err, files.Unreachable):  # a shard's URL already named
            raise files.Unreachable(f"{err} (while reading {where})") from err
        cause = files.network_cause(err)
        if cause is None:
            raise
        raise files.unreachable(f"{ds.root} ({where})", cause) from err


class TrainLoader(DataLoader):
    """A DataLoader that raises a worker's exception in the main process as itself (see WorkerFailure);
    otherwise torch's DataLoader unchanged."""

    def __iter__(self):
        for item in super().__iter__():
            if isinstance(item, WorkerFailure):
                raise item.error()
            yield item


def make_loader(path: str | TrainDataset, *, batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                block: int = 1, shuffle: bool = True, start_step: int = 0, num_steps: int | None = None,
                num_workers: int = 0, pin_memory: bool = False, prefetch_factor: int = 2, image_transform=None):
    """DataLoader of this rank's slices of global batches of ``batch_size`` (module docstring); local or
    fsspec ``path``. ``num_steps`` None: one pass (``N // batch_size`` batches). ``image_transform``: applied
    to each batch's pixels in the workers (:class:`toolkit.data.augment.PixelTransform`). Called by every
    rank once."""
    ds = path if isinstance(path, TrainDataset) else TrainDataset.open(str(path))
    order = (BatchOrder if shuffle else InOrder)(ds.num_samples, batch_size, seed, block)
    steps = order.batches_per_pass if num_steps is None else num_steps
    stream = GlobalBatchStream(ds, order, rank=rank, world_size=world_size, start_step=start_step, num_steps=steps,
                               image_transform=image_transform)
    extra = {"prefetch_factor": prefetch_factor, "persistent_workers": False} if num_workers > 0 else {}
    return TrainLoader(stream, batch_size=None, num_workers=num_workers, pin_memory=pin_memory, **extra)
