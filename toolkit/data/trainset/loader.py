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
them round-robin, so batches arrive in t order. Each storage mode reads its own way (``StorageMode.reader``):
jpeg and index sets (``storage/tables.py``) read each image's bytes through
their table and decode them in the worker; pixels sets (``storage/pixels.py``) are read by seeking (fixed-size
samples): the ids of a slice are sorted, grouped into runs of consecutive ids per shard, and each run is one
read call, on a local disk straight into the rows its samples take in the batch (:mod:`.scatter`, one copy per
byte); ``block`` > 1 makes runs long (sequential reads for object stores). ``shuffle=False`` reads every id
once, in order, on one process (``InOrder``), for inspection and tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset

from toolkit.core import files
from toolkit.data.trainset import integrity, storage
from toolkit.data.trainset.format import TrainDataset
from toolkit.data.trainset.order import BatchOrder


def make_reader(ds: TrainDataset, vocab_size: int | None = None):
    """The sample reader of ``ds``'s storage mode (``StorageMode.reader``: pixels' seeking
    :class:`~toolkit.data.trainset.storage.pixels.SampleReader`, the table modes' decoding
    :class:`~toolkit.data.trainset.storage.tables.RefReader`)."""
    return storage.of(ds).reader(ds, vocab_size)


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

    return {
        role: torch.from_numpy(a.astype(np.int64) if role == "tokens" else a) for role, a in arrays.items()
    }


class GlobalBatchStream(IterableDataset):
    """This rank's slices of global batches [start_step, start_step + num_steps) (module docstring)."""

    def __init__(
        self,
        ds: TrainDataset,
        order: BatchOrder,
        *,
        rank: int,
        world_size: int,
        start_step: int,
        num_steps: int,
        image_transform=None,
    ):
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
                image = (
                    arrays.pop("image") if self.image_transform is not None and "image" in arrays else None
                )
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


def make_loader(
    path: str | TrainDataset,
    *,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    block: int = 1,
    shuffle: bool = True,
    start_step: int = 0,
    num_steps: int | None = None,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: int = 2,
    image_transform=None,
):
    """DataLoader of this rank's slices of global batches of ``batch_size`` (module docstring); local or
    fsspec ``path``. ``num_steps`` None: one pass (``N // batch_size`` batches). ``image_transform``: applied
    to each batch's pixels in the workers (:class:`toolkit.data.augment.PixelTransform`). Called by every
    rank once."""
    ds = path if isinstance(path, TrainDataset) else TrainDataset.open(str(path))
    storage.of(ds)  # a mode nobody registered fails here, in the calling process, naming dataset.json
    order = (BatchOrder if shuffle else InOrder)(ds.num_samples, batch_size, seed, block)
    steps = order.batches_per_pass if num_steps is None else num_steps
    stream = GlobalBatchStream(
        ds,
        order,
        rank=rank,
        world_size=world_size,
        start_step=start_step,
        num_steps=steps,
        image_transform=image_transform,
    )
    extra = {"prefetch_factor": prefetch_factor, "persistent_workers": False} if num_workers > 0 else {}
    return TrainLoader(stream, batch_size=None, num_workers=num_workers, pin_memory=pin_memory, **extra)
