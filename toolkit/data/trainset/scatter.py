"""Pixels-set reads from local shards straight into batch order: one ``preadv`` per run, one copy per byte.

The portable path (``segment.read_rows_into``) copies every byte twice: page cache -> a staging buffer
(readinto), then staging -> batch order (one fancy index per field). Here each run of consecutive ids is
one ``os.preadv`` whose buffers are the rows the samples land in: each field's bytes go from the page
cache into that sample's row of the batch's contiguous field array, and the member headers and padding
into a reused scratch buffer, so the kernel's copy is the only one. Each sample is then hashed from those
pieces (xxh3-64 streamed over them equals the hash of the sample's bytes as they lie in the tar), while
they are still in the CPU's cache. :class:`toolkit.data.trainset.storage.pixels.SampleReader` uses this for
shards on a local file system where ``os.preadv`` exists; fsspec URLs keep the portable path.

Why not ``mmap``: a read-only map of each shard, each sample hashed in the map and copied once into
batch order, was measured against both (249 px samples, batch 128, one core, load ~5, best of 6
interleaved passes): 3 shards, all mapped at once: staging 17.0k, mmap 19.9k, preadv 28.7k samples/s;
205 shards, more than ``MAX_OPEN_FILES`` (the usual case at scale: 1000 samples a shard), so maps are
made and dropped all the time: staging 12.2k, mmap 10.1k, preadv 20.4k. Each first touch of a mapped
page is a page fault; preadv's copy is the kernel's, with no fault and no staging buffer.

Integrity is what the portable path checks, with its error texts: each sample's xxh3-64 against the
shard's sidecar (the hash covers the member headers, so a sample that matches also carries its own
member name; the name is checked on its own only in sets without checksums, or to say what is wrong when
a hash differs), and a shard shorter than dataset.json says is refused when it is opened, naming the file
and both sizes. A file truncated while open gives a short read: the portable path's "ended inside
sample" error.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from toolkit.data.trainset import integrity
from toolkit.data.trainset.format import TrainDataset
from toolkit.data.trainset.segment import check_first_member, field_offsets

# Buffers one preadv call may take (POSIX IOV_MAX; 1024 on Linux): a run of more samples takes several calls.
try:
    IOV_MAX = os.sysconf("SC_IOV_MAX")
except (AttributeError, ValueError, OSError):
    IOV_MAX = 16  # the POSIX minimum


def available() -> bool:
    """Whether this platform has ``os.preadv`` (Linux, the BSDs, macOS 11+; not Windows)."""
    return hasattr(os, "preadv")


def check_size(ds: TrainDataset, shard: int, fh: Any) -> None:
    """Refuse shard ``shard`` (open local file ``fh``) when it holds fewer bytes than dataset.json says,
    naming the file and both sizes: when it is opened, not when a batch first reaches past its end."""
    info = ds.shards[shard]
    expected, size = info.num_samples * ds.sample_bytes, os.fstat(fh.fileno()).st_size
    if size < expected:
        raise integrity.DataIntegrityError(
            f"{ds.url(info)}: {size} bytes, shorter than the {expected} bytes dataset.json says "
            f"({info.num_samples} samples of {ds.sample_bytes} bytes; cut off from sample "
            f"{size // ds.sample_bytes}); "
            "restore it or precompute this dataset again"
        )


class ScatterReads:
    """The batch layout of one pixels set: which bytes of a sample go to which field array (one per
    process; each DataLoader worker builds its own reader)."""

    def __init__(self, ds: TrainDataset):
        self.ds, self.sample_bytes = ds, ds.sample_bytes  # a property that sums the fields: ~4 us a call
        self._fields = [(f, f.nbytes, np.dtype(f.dtype).newbyteorder("<")) for f in ds.fields]
        # a sample's bytes in file order: (field index, nbytes) or (-1, nbytes) for headers and padding
        self.segments, pos = [], 0
        for k, (f, offset) in enumerate(zip(ds.fields, field_offsets(ds), strict=True)):
            self.segments += [(-1, offset - pos), (k, f.nbytes)]
            pos = offset + f.nbytes
        self.segments += [(-1, ds.sample_bytes - pos)] if ds.sample_bytes > pos else []
        self.scratch_bytes = sum(n for k, n in self.segments if k < 0)
        self.samples_per_call = max(1, IOV_MAX // len(self.segments))
        self._scratch = np.empty(0, np.uint8)
        self._hash = xxhash.xxh3_64()

    def read(
        self,
        runs: list[tuple[int, int, list[int]]],
        file: Callable[[int], Any],
        sums: Callable[[int], list[int] | None],
    ) -> dict[str, np.ndarray]:
        """{role: C-contiguous array [n, *shape]}: for each run (shard, first position, rows), samples
        ``first position ..`` of the shard read into rows ``rows`` (n rows in all, each filled once);
        ``file(shard)``: its open local file, ``sums(shard)``: its hashes (None: unverified)."""
        n = sum(len(rows) for _, _, rows in runs)
        flat = [np.empty(n * nbytes, np.uint8) for _, nbytes, _ in self._fields]
        if self._scratch.size < n * self.scratch_bytes:
            self._scratch = np.empty(n * self.scratch_bytes, np.uint8)
        targets = [memoryview(a) for a in flat]
        scratch = memoryview(self._scratch)
        for shard, start, rows in runs:
            fd, shard_sums = file(shard).fileno(), sums(shard)
            for c0 in range(0, len(rows), self.samples_per_call):
                chunk = rows[c0 : c0 + self.samples_per_call]
                self._read_chunk(fd, shard, start + c0, chunk, targets, scratch, shard_sums)
        return {
            f.role: a.view(dtype).reshape(n, *f.shape)
            for a, (f, _, dtype) in zip(flat, self._fields, strict=True)
        }

    def _read_chunk(
        self,
        fd: int,
        shard: int,
        start: int,
        rows: list[int],
        targets: list[memoryview],
        scratch: memoryview,
        sums: list[int] | None,
    ) -> None:
        """Samples ``start .. start+len(rows)-1`` of the shard into ``rows``: one preadv, then each
        verified."""
        ds, size, per_sample = self.ds, self.sample_bytes, len(self.segments)
        pieces = []
        for row in rows:
            at = row * self.scratch_bytes
            for k, nbytes in self.segments:
                if k < 0:
                    pieces.append(scratch[at : at + nbytes])
                    at += nbytes
                else:
                    pieces.append(targets[k][row * nbytes : (row + 1) * nbytes])
        got = os.preadv(fd, pieces, start * size)
        if got != len(rows) * size:
            got = _preadv_rest(fd, pieces, start * size, got)
        if got != len(rows) * size:  # only a file cut short after check_size saw it whole
            raise ValueError(
                f"{ds.url(ds.shards[shard])}: ended inside sample {start + got // size} "
                f"(dataset.json says {ds.shards[shard].num_samples} samples)"
            )
        digest = self._hash
        for j in range(len(rows)):
            own = pieces[j * per_sample : (j + 1) * per_sample]
            if sums is None:
                check_first_member(ds, shard, start + j, own[0])
                continue
            digest.reset()
            for piece in own:
                digest.update(piece)
            if digest.intdigest() != sums[start + j]:
                check_first_member(ds, shard, start + j, own[0])  # misnamed: say so
                raise integrity.damaged(
                    ds, shard, start + j, "its checksum does not match the one precompute wrote"
                )


def _preadv_rest(fd: int, pieces: list[memoryview], offset: int, total: int) -> int:
    """After a preadv into ``pieces`` at ``offset`` returned ``total`` bytes, fewer than asked (POSIX allows
    that before the end of a file, though local files rarely do it), read the rest; returns the bytes
    read in all, short only at the end of the file."""
    first, got = 0, total
    while first < len(pieces):
        while first < len(pieces) and got >= len(pieces[first]):  # skip the pieces this call filled
            got -= len(pieces[first])
            first += 1
        if got:
            pieces = [*pieces[:first], pieces[first][got:], *pieces[first + 1 :]]  # the rest of a partial one
        if first == len(pieces):
            break
        got = os.preadv(fd, pieces[first:], offset + total)
        if got == 0:
            break
        total += got
    return total
