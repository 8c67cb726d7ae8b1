"""Reading training shards by seeking: any run of samples of a pixels shard without reading what lies
before it (the fixed tar layout of :mod:`toolkit.data.trainset.format`: sample k of a shard starts at byte
``k * sample_bytes``).

:class:`Segment` names a run of samples (the unit every storage mode's ``read_segment`` reads);
:func:`read_segment` reads one directly (:func:`read_rows_into`: one seek, one read; each sample's first
member name checked against its id, its checksum verified), :func:`read_segment_webdataset` through
webdataset's tar parser (the portable, slower reader). The loader, ``data verify`` and ``data inspect`` use
them through the storage modes (:mod:`toolkit.data.trainset.storage.pixels`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from toolkit.core import files
from toolkit.data.trainset import integrity
from toolkit.data.trainset.format import BLOCK, TrainDataset, id_key

# Samples per read call of the direct reader: big reads, while a shuffle buffer keeps little extra alive.
READ_CHUNK = 32


@dataclass(frozen=True)
class Segment:
    """``count`` consecutive samples of shard ``shard`` from sample ``start``; ``valid`` False for padding."""

    shard: int
    start: int
    count: int
    valid: bool = True


class _Limited:
    """A read-only view of the next ``size`` bytes of ``fh`` (so the tar stream ends at a segment end)."""

    def __init__(self, fh, size: int):
        self.fh, self.left = fh, size

    def read(self, n: int = -1) -> bytes:
        n = self.left if n is None or n < 0 else min(n, self.left)
        data = self.fh.read(n) if n else b""
        self.left -= len(data)
        return data


def _layout_error(url: str, position: int, expected: str, found: Any) -> ValueError:
    return ValueError(
        f"{url}: sample {position} is {found!r}, expected {expected!r}: the shard does not "
        "match dataset.json (rewritten or damaged?)"
    )


def read_segment_webdataset(ds: TrainDataset, seg: Segment) -> Iterator[dict[str, Any]]:
    """Samples of one segment as dicts {role: array, 'index': id, 'valid': bool}, parsed by webdataset's
    tar iterator after seeking to the segment's first byte (the portable, slower reader)."""
    from webdataset.tariterators import group_by_keys, tar_file_iterator

    shard = ds.shards[seg.shard]
    url, size = ds.url(shard), ds.sample_bytes
    with files.open_file(url, "rb") as fh:
        fh.seek(seg.start * size)
        members = (dict(m, __url__=url) for m in tar_file_iterator(_Limited(fh, seg.count * size)))
        for k, sample in enumerate(group_by_keys(members)):
            sample_id = shard.first_id + seg.start + k
            if sample["__key__"] != id_key(sample_id):
                raise _layout_error(url, seg.start + k, id_key(sample_id), sample["__key__"])
            out = {f.role: f.decode(sample[f.ext]) for f in ds.fields}
            out["index"], out["valid"] = sample_id, seg.valid
            yield out
            if k + 1 == seg.count:
                return
    raise ValueError(
        f"{url}: ended before sample {seg.start + seg.count} (dataset.json says {shard.num_samples})"
    )


def open_shard(ds: TrainDataset, shard: int):
    """Open pixels shard ``shard`` for reading (local or fsspec); a missing file is a DataIntegrityError
    naming it."""
    url = ds.url(ds.shards[shard])
    try:  # remote: a read is one range request of exactly its run of samples
        return files.open_ranges(url)
    except FileNotFoundError as err:
        if (cause := files.network_cause(err)) is not None:  # the server is gone, not the file
            raise files.unreachable(url, cause) from err
        raise integrity.DataIntegrityError(
            f"{url}: missing (shard {shard} of {len(ds.shards)} in dataset.json); "
            "restore it or precompute this dataset again"
        ) from err


def field_offsets(ds: TrainDataset) -> list[int]:
    """Byte offset of each field's data inside one sample (each member's data follows its 512-byte header)."""
    offsets, pos = [], 0
    for f in ds.fields:
        offsets.append(pos + BLOCK)
        pos += f.padded_bytes
    return offsets


def read_rows(
    fh: Any, ds: TrainDataset, shard_index: int, start: int, count: int, sums: list[int] | None = None
) -> np.ndarray:
    """Samples ``start .. start+count-1`` of shard ``shard_index`` from the open file ``fh``, as raw bytes
    [count, sample_bytes] in a new array (:func:`read_rows_into`)."""
    return read_rows_into(fh, ds, shard_index, start, np.empty((count, ds.sample_bytes), np.uint8), sums)


def read_rows_into(
    fh: Any, ds: TrainDataset, shard_index: int, start: int, rows: np.ndarray, sums: list[int] | None = None
) -> np.ndarray:
    """Read samples ``start .. start+len(rows)-1`` of shard ``shard_index`` into ``rows`` (C-contiguous
    uint8 [n, sample_bytes]; one seek, one read, no intermediate buffer) and return it. Each sample's first
    member name is checked against its expected id, so a shard that does not match dataset.json fails
    loudly, naming the shard; with the shard's ``sums`` (:func:`integrity.load_sums`) every sample's
    checksum is verified as well, while its bytes are still in cache."""
    shard = ds.shards[shard_index]
    url, size, count = ds.url(shard), ds.sample_bytes, rows.shape[0]
    fh.seek(start * size)
    view = memoryview(rows).cast("B")
    got = _read_into(fh, view)
    if got != count * size:
        raise ValueError(
            f"{url}: ended inside sample {start + got // size} "
            f"(dataset.json says {shard.num_samples} samples)"
        )
    for k in range(count):
        check_first_member(ds, shard_index, start + k, view[k * size : k * size + 100])
    integrity.check_sums(ds, shard_index, start, view, sums)
    return rows


def check_first_member(ds: TrainDataset, shard_index: int, position: int, head: bytes | memoryview) -> None:
    """Raise the layout error (:func:`_layout_error`) when sample ``position`` of the shard (``head``: its
    first bytes, 100 or more) does not start with a member named after its id."""
    shard = ds.shards[shard_index]
    name = f"{id_key(shard.first_id + position)}.{ds.fields[0].ext}".encode() + b"\0"
    if head[: len(name)] != name:
        raise _layout_error(ds.url(shard), position, name[:-1].decode(), bytes(head[:100]).split(b"\0")[0])


def _read_into(fh: Any, view: memoryview) -> int:
    """Fill ``view`` from ``fh`` (readinto where the file has it); returns the bytes read (short at EOF)."""
    readinto = getattr(fh, "readinto", None)
    if readinto is None:
        data = fh.read(len(view))
        view[: len(data)] = data
        return len(data)
    filled = 0
    while filled < len(view):
        n = readinto(view[filled:])
        if not n:
            break
        filled += n
    return filled


def decode_rows(ds: TrainDataset, rows: np.ndarray) -> dict[str, np.ndarray]:
    """Raw sample rows [n, sample_bytes] -> {role: array [n, *shape]} (views of ``rows``, little-endian)."""
    n = rows.shape[0]
    return {
        f.role: rows[:, o : o + f.nbytes].view(np.dtype(f.dtype).newbyteorder("<")).reshape(n, *f.shape)
        for f, o in zip(ds.fields, field_offsets(ds), strict=True)
    }


def read_segment(ds: TrainDataset, seg: Segment, chunk: int = READ_CHUNK) -> Iterator[dict[str, Any]]:
    """Same output as :func:`read_segment_webdataset`, reading the fixed tar layout directly with
    :func:`read_rows` (``chunk`` samples per read call, fields as numpy views of the read buffer). Pixels
    sets only: each storage mode reads its own (``StorageMode.read_segment``)."""
    shard = ds.shards[seg.shard]
    sums, vocab = integrity.load_sums(ds, seg.shard), integrity.vocab_size(ds)
    with files.open_file(ds.url(shard), "rb") as fh:
        for c0 in range(0, seg.count, chunk):
            n = min(chunk, seg.count - c0)
            views = decode_rows(ds, read_rows(fh, ds, seg.shard, seg.start + c0, n, sums))
            if "tokens" in views:
                integrity.check_tokens(ds, seg.shard, seg.start + c0, views["tokens"], vocab)
            for k in range(n):
                out = {role: v[k] for role, v in views.items()}
                out["index"], out["valid"] = shard.first_id + seg.start + c0 + k, seg.valid
                yield out
