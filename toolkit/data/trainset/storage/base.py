"""The interface every storage mode implements (the registry is :mod:`toolkit.data.trainset.storage`).

A mode is a stateless object; precompute decides the mode once (``storage.get(cfg.storage)``) and hands it
to its workers inside the job. Which process calls what:

- precompute workers: :meth:`StorageMode.image_rows` per raw shard (one scratch row per kept image);
- the precompute parent (rank 0): :meth:`scratch_image`, :meth:`write`, :meth:`extra`, :attr:`suffixes`;
- every reader (loader workers, verify, inspect): :meth:`sample_bytes`, :meth:`reader`, :meth:`read_segment`,
  :meth:`verify_part`, :meth:`stored_files`; ``toolkit plan``: :meth:`disk_bytes_per_sample`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np

from toolkit.data.trainset.format import BLOCK, Field, TrainDataset
from toolkit.data.trainset.segment import Segment

# Open data files a reader keeps (a global order touches every shard; reopening costs a round trip on
# object stores). 64 handles stay well under the usual 1024 open-files limit with several loader workers.
MAX_OPEN_FILES = 64
# jpeg/index scratch rows: (offset, length, xxh3-64) of the image bytes, little-endian uint64 each; for
# index the offset is into the raw tar, for jpeg into the shard's '<stem>.jpg' scratch file.
REF_ROW = np.dtype([("offset", "<u8"), ("length", "<u8"), ("hash", "<u8")])


class ImageRows:
    """A worker's image rows of one raw shard: :meth:`row` gives each kept image's scratch row (bytes of the
    mode's scratch image field); :meth:`close` ends the shard; :meth:`check` looks at the finished rows."""

    def row(self, sample: Any, ext: str, data: bytes, pixels: np.ndarray) -> bytes:
        """The scratch row of one kept image: raw ``sample`` (its offsets), member ``ext`` holding the
        encoded ``data``, decoded ``pixels`` uint8 [S, S, 3] at the stored side."""
        return pixels.tobytes()

    def close(self) -> None:
        """The raw shard's last image is in."""

    def check(self, image_path: str) -> None:
        """After a shard with kept samples: ValueError (naming the shard) if its rows cannot be read back."""


class StorageMode(ABC):
    """How a training set stores its images; one object per mode (module docstring)."""

    name: ClassVar[str]
    # Per-part files the mode writes beside NNNNN.meta.jsonl, as suffixes (".tar", ".idx", ...): a rerun into
    # the same folder removes another mode's (storage.remove_stale_parts).
    suffixes: ClassVar[tuple[str, ...]]
    # What its per-part files are called in precompute's progress ("write shards").
    parts_noun: ClassVar[str] = "shards"
    # True when frozen-tower features (fixed-size float16 rows instead of pixels or tokens) can be stored.
    holds_features: ClassVar[bool] = False

    # ------------------------------------------------------------ precompute
    def scratch_image(self, image: Field) -> Field:
        """The fixed-size scratch row of one kept image for the stored ``image`` field (default: its
        pixels)."""
        return image

    def image_rows(self, job: Any, stem: str, url: str) -> ImageRows:
        """Worker side: the image rows of raw shard ``url``, whose scratch files start with ``stem``."""
        return ImageRows()

    @abstractmethod
    def write(self, job: Any, samples: Iterator, urls: list[str]) -> tuple[list, str, list[str]]:
        """Parent side: ``samples`` ((result, scratch row, meta line) of every kept sample, in id order) into
        the training files under ``job.cfg.out``; the job gives ``fields``, ``scratch_rows(result)``,
        ``stem(result)`` and ``split_reference(row)``. Returns (shards, data_root, data_files) for
        dataset.json; ``urls``: the raw shards, in order."""

    def extra(self, job: Any) -> dict:
        """Provenance this mode adds to dataset.json's ``extra``."""
        return {}

    # ------------------------------------------------------------ reading
    @abstractmethod
    def sample_bytes(self, ds: TrainDataset) -> int:
        """Bytes a sample takes in the per-part file readers seek in (a shard's sample, a table record): the
        ``sample_bytes`` dataset.json records."""

    def field_bytes(self, field: Field) -> int:
        """Bytes one sample's ``field`` takes on disk (reference.bytes_per_sample)."""
        return field.nbytes

    @abstractmethod
    def reader(self, ds: TrainDataset, vocab_size: int | None) -> Any:
        """A reader of arbitrary ids: ``read(ids [n] int64) -> {role: array [n, ...]}`` (each read checked),
        ``close()``; one per process (each DataLoader worker makes its own)."""

    @abstractmethod
    def read_segment(self, ds: TrainDataset, seg: Segment) -> Iterator[dict[str, Any]]:
        """Samples of ``seg`` in order as {role: array, 'index': id, 'valid': bool} (inspect's sheet)."""

    @abstractmethod
    def verify_part(
        self, ds: TrainDataset, index: int, vocab: int | None, count: Any, notes: dict
    ) -> list[tuple[str, bool]]:
        """(message, is a sample problem) for every problem of part ``index``, all of them (not the first
        only); advances ``count`` by the part's samples. ``notes``: one dict per verify run, where a mode
        gathers what its :meth:`verify_lines` reports after the last part."""

    def verify_lines(self, ds: TrainDataset, notes: dict) -> list[str]:
        """Problems of the whole set that no single part shows, from the parts' ``notes``; none by default."""
        return []

    @abstractmethod
    def stored_files(self, ds: TrainDataset) -> list[str]:
        """Names (relative to the folder) of the per-sample files besides the parts and meta sidecars."""

    @abstractmethod
    def disk_bytes_per_sample(self, image_side: int, context_length: int) -> float:
        """Bytes a sample takes in the folder for a stored side and context (meta line not counted)."""


def padded(nbytes: int) -> int:
    """A tar member of ``nbytes``: its 512-byte header and its data padded to 512."""
    return BLOCK + -(-nbytes // BLOCK) * BLOCK
