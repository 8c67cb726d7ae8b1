"""Storage mode ``pixels``: decoded, resized images in fixed-size tar samples (:mod:`..format`), or
frozen-tower features in their place. The loader seeks to any sample and copies it (:class:`SampleReader`);
every read is checked against the per-sample checksums (:mod:`..integrity`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from toolkit.core import files
from toolkit.data.trainset import integrity
from toolkit.data.trainset import scatter as scatter_reads
from toolkit.data.trainset.format import BLOCK, Field, TrainDataset, id_key
from toolkit.data.trainset.segment import Segment, decode_rows, open_shard, read_rows_into, read_segment
from toolkit.data.trainset.storage.base import MAX_OPEN_FILES, StorageMode, padded
from toolkit.data.trainset.writer import TrainShardWriter

# Samples per read call of verify: 256 x a 224 px sample (~150 kB) keeps one read under 40 MB.
VERIFY_CHUNK = 256


class PixelsMode(StorageMode):
    """``--storage pixels`` (the default): fastest to train from, ~W*H*3 bytes a sample."""

    name = "pixels"
    suffixes = (".tar", "." + integrity.SUMS_EXT)
    holds_features = True

    def write(self, job: Any, samples: Iterator, urls: list[str]) -> tuple[list, str, list[str]]:
        """Pixels (or frozen-feature) training shards from ``samples`` ((result, row, meta) in id order);
        returns (shards, data_root "", data_files [])."""
        cfg = job.cfg
        writer = TrainShardWriter(cfg.out, job.fields, cfg.samples_per_shard)
        current, rows = None, []
        try:
            for sample_id, (res, row, meta) in enumerate(samples):
                if res is not current:  # results arrive in order: one shard's memmaps open at a time
                    current, rows = res, job.scratch_rows(res)
                payloads = [rows[0][row].tobytes(), rows[1][row].tobytes()]
                if len(rows) > 2:  # ref_image, ref_text
                    payloads += job.split_reference(rows[2][row])
                writer.add(sample_id, payloads, meta)
            return writer.close(), "", []
        except OSError as err:  # a full disk: name the shard and free its space for the failed manifest
            shard = writer.discard()
            raise OSError(
                err.errno,
                f"{err.strerror or err} while writing the training shard {shard or cfg.out} "
                f"(into --out {cfg.out}); free space there and rerun (processed raw shards "
                "are kept)",
            ) from err

    def sample_bytes(self, ds: TrainDataset) -> int:
        return ds.sample_bytes

    def field_bytes(self, field: Field) -> int:
        return field.padded_bytes  # a tar member: header and padding included

    def reader(self, ds: TrainDataset, vocab_size: int | None) -> SampleReader:
        return SampleReader(ds, vocab_size)

    def read_segment(self, ds: TrainDataset, seg: Segment) -> Iterator[dict[str, Any]]:
        return read_segment(ds, seg)

    def verify_part(
        self, ds: TrainDataset, index: int, vocab: int | None, count: Any, notes: dict
    ) -> list[tuple[str, bool]]:
        return _verify_shard(ds, index, vocab, count)

    def stored_files(self, ds: TrainDataset) -> list[str]:
        return [integrity.sums_file(s.name) for s in ds.shards if s.sums]

    def disk_bytes_per_sample(self, image_side: int, context_length: int) -> float:
        # two tar members (uint8 pixels, int32 tokens) and the sample's 8-byte checksum
        return padded(image_side * image_side * 3) + padded(4 * context_length) + 8


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
            raise IndexError(
                f"{self.ds.root}: sample ids must lie in [0, {self.ds.num_samples}), got "
                f"{int(ids.min())}..{int(ids.max())}"
            )
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        shards = np.searchsorted(self.first_ids, sorted_ids, side="right") - 1
        breaks = np.flatnonzero((np.diff(sorted_ids) != 1) | (np.diff(shards) != 0)) + 1
        if self._scatter is not None:
            rows, starts, cuts = (
                order.tolist(),
                (sorted_ids - self.first_ids[shards]).tolist(),
                breaks.tolist(),
            )
            shard_of = shards.tolist()  # Python ints: numpy scalars cost ~10x more per run (one run a sample)
            runs = [
                (shard_of[lo], starts[lo], rows[lo:hi])
                for lo, hi in zip([0, *cuts], [*cuts, len(rows)], strict=True)
                if hi > lo
            ]
            out = self._scatter.read(runs, self._file, self._shard_sums)
        else:
            out = self._read_runs(ids, order, sorted_ids, shards, breaks)
        if "tokens" in out:  # once per batch: shuffled ids make runs of ~1 sample, too short to vectorise
            integrity.check_batch_tokens(self.ds, ids, out["tokens"], self.vocab_size)
        return out

    def _read_runs(
        self,
        ids: np.ndarray,
        order: np.ndarray,
        sorted_ids: np.ndarray,
        shards: np.ndarray,
        breaks: np.ndarray,
    ) -> dict[str, np.ndarray]:
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


def _verify_shard(ds: TrainDataset, index: int, vocab: int | None, count) -> list[tuple[str, bool]]:
    """(message, is a sample problem) for every problem of one shard."""
    shard, size = ds.shards[index], ds.sample_bytes
    url = ds.url(shard)
    try:
        sums = integrity.load_sums(ds, index) if shard.sums else None
        fh = files.open_file(url, "rb")
    except (OSError, ValueError) as err:
        count.advance(shard.num_samples)
        return [(f"{url}: {err}" if url not in str(err) else str(err), False)]
    found: list[tuple[str, bool]] = []
    with fh:
        fh.seek(0, 2)
        length = fh.tell()
        readable = min(shard.num_samples, length // size)
        for start in range(0, readable, VERIFY_CHUNK):
            n = min(VERIFY_CHUNK, readable - start)
            fh.seek(
                start * size
            )  # not read_rows: it stops at the first misnamed sample, verify lists them all
            rows = np.frombuffer(fh.read(n * size), np.uint8).reshape(n, size)
            found += _check_rows(ds, index, start, rows, sums, vocab)
            count.advance(n)
        if readable < shard.num_samples:
            found.append(
                (
                    f"{url}: ends inside sample {readable} ({length} bytes; dataset.json says "
                    f"{shard.num_samples} samples of {size} bytes)",
                    False,
                )
            )
            count.advance(shard.num_samples - readable)
        else:
            fh.seek(shard.num_samples * size)
            if fh.read(2 * BLOCK) != bytes(2 * BLOCK):
                found.append(
                    (
                        f"{url}: no end-of-archive marker after sample {shard.num_samples - 1}: data was "
                        "appended or the tail is damaged",
                        False,
                    )
                )
    return found


def _check_rows(
    ds: TrainDataset, index: int, start: int, rows, sums, vocab: int | None
) -> list[tuple[str, bool]]:
    """Every damaged sample of ``rows`` ([n, sample_bytes], samples start.. of shard ``index``)."""
    shard, name_ext = ds.shards[index], ds.fields[0].ext
    tokens = decode_rows(ds, rows).get("tokens")
    found = []
    for k in range(rows.shape[0]):
        position = start + k
        name = f"{id_key(shard.first_id + position)}.{name_ext}".encode() + b"\0"
        try:
            if bytes(rows[k, : len(name)]) != name:
                raise integrity.damaged(
                    ds, index, position, f"its first member is not named {name[:-1].decode()}"
                )
            integrity.check_sums(ds, index, position, rows[k : k + 1], sums)
            if tokens is not None:
                integrity.check_tokens(ds, index, position, tokens[k : k + 1], vocab)
        except integrity.DataIntegrityError as err:
            found.append((str(err).split("; run `toolkit data verify")[0], True))
    return found
