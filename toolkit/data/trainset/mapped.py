"""Pixels-set reads through read-only maps of local shards: each batch gathered in batch order, one copy per byte.

The seek-and-read path (``format.read_rows_into``) copies every byte twice: page cache -> a staging buffer
(readinto), then staging -> batch order (one fancy index per field). A read-only ``mmap`` of the shard
exposes the page cache itself, so :meth:`MappedShards.gather` hashes each sample where it lies (xxh3 on a
zero-copy memoryview slice) and copies each field of it once, straight into its row of the batch's
contiguous output array, while the sample is still in the CPU's cache. Used by
:class:`toolkit.data.trainset.loader.SampleReader` for shards on a local file system; fsspec URLs keep the
seek-and-read path.

Integrity is what the seek-and-read path checks, with its error texts: each sample's xxh3-64 against the
shard's sidecar (the hash covers the member headers, so a sample that matches also carries its own
member name; the name is checked on its own only in sets without checksums, or to say what is wrong when
a hash differs), and a shard shorter than dataset.json says is refused when it is mapped, naming the file
and both sizes: touching a mapped page past the end of a file kills the process with SIGBUS instead of
raising.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable

import numpy as np
import xxhash

from toolkit.data.trainset import integrity
from toolkit.data.trainset.format import TrainDataset, check_first_member, field_offsets, open_shard

# Bytes of a sample's first member header handed to the name check, copied out of the map: an error's
# traceback must hold no slice of a map, or closing the map would fail (BufferError) and hide the error.
HEAD_BYTES = 100


class MappedShards:
    """Read-only maps of a local pixels set's shards, at most ``max_open`` at a time (the least recently
    opened is unmapped first); one per process: each DataLoader worker maps the shards itself, after the
    fork. ``sums(shard)`` gives a shard's per-sample hashes (``integrity.load_sums``; None: unverified)."""

    def __init__(self, ds: TrainDataset, max_open: int, sums: Callable[[int], list[int] | None]):
        self.ds, self.max_open, self.sums = ds, max_open, sums
        self.first_ids = [s.first_id for s in ds.shards]
        self._maps: dict[int, tuple[mmap.mmap, memoryview]] = {}
        self._fields = [(f, offset, np.dtype(f.dtype).newbyteorder("<"))
                        for f, offset in zip(ds.fields, field_offsets(ds), strict=True)]

    def view(self, shard: int) -> memoryview:
        """The mapped bytes of shard ``shard`` (its first ``num_samples * sample_bytes`` bytes)."""
        if shard not in self._maps:
            if len(self._maps) >= self.max_open:
                self._unmap(next(iter(self._maps)))
            self._maps[shard] = self._map(shard)
        return self._maps[shard][1]

    def _map(self, shard: int) -> tuple[mmap.mmap, memoryview]:
        ds, info = self.ds, self.ds.shards[shard]
        expected = info.num_samples * ds.sample_bytes
        with open_shard(ds, shard) as fh:  # the map keeps its own descriptor; this one closes here
            size = os.fstat(fh.fileno()).st_size
            if size < expected:
                raise integrity.DataIntegrityError(
                    f"{ds.url(info)}: {size} bytes, shorter than the {expected} bytes dataset.json says "
                    f"({info.num_samples} samples of {ds.sample_bytes} bytes; cut off from sample "
                    f"{size // ds.sample_bytes}); restore it or precompute this dataset again")
            # A file truncated in place after this check (precompute replaces shards by rename, which
            # leaves this map on the old file) makes the next touch of a page past its new end a SIGBUS:
            # the process dies ("DataLoader worker ... killed by signal: Bus error") instead of raising.
            mapped = mmap.mmap(fh.fileno(), expected, prot=mmap.PROT_READ) if expected else mmap.mmap(-1, 1)
        return mapped, memoryview(mapped)[:expected]

    def _unmap(self, shard: int) -> None:
        mapped, view = self._maps.pop(shard)
        view.release()
        try:
            mapped.close()
        except BufferError:  # a slice still referenced somewhere: the map goes when the last reference does
            pass

    def close(self) -> None:
        for shard in list(self._maps):
            self._unmap(shard)

    def gather(self, sorted_ids: list[int], shard_of: list[int], dest: list[int]) -> dict[str, np.ndarray]:
        """{role: C-contiguous array [n, *shape]} of the n samples ``sorted_ids`` (ascending; in shards
        ``shard_of``), sample ``sorted_ids[j]`` landing in row ``dest[j]``; each verified before it is used.

        One Python iteration per sample: hash its bytes in the map, copy each field into its row. Walking
        in id order keeps the first damaged sample named the one the seek-and-read path names."""
        ds, size, n = self.ds, self.ds.sample_bytes, len(sorted_ids)
        flat = [np.empty(n * f.nbytes, np.uint8) for f, _, _ in self._fields]
        plan = [(memoryview(out), offset, f.nbytes) for out, (f, offset, _) in zip(flat, self._fields, strict=True)]
        digest, shard, view, sums, first = xxhash.xxh3_64_intdigest, -1, None, None, 0
        for sample_id, s, row in zip(sorted_ids, shard_of, dest, strict=True):
            if s != shard:
                shard, view, sums, first = s, self.view(s), self.sums(s), self.first_ids[s]
            pos = sample_id - first
            base = pos * size
            if sums is None:
                check_first_member(ds, shard, pos, bytes(view[base:base + HEAD_BYTES]))
            elif digest(view[base:base + size]) != sums[pos]:
                check_first_member(ds, shard, pos, bytes(view[base:base + HEAD_BYTES]))  # misnamed: say so
                raise integrity.damaged(ds, shard, pos, "its checksum does not match the one precompute wrote")
            for out, offset, nbytes in plan:
                out[row * nbytes:(row + 1) * nbytes] = view[base + offset:base + offset + nbytes]
        return {f.role: out.view(dtype).reshape(n, *f.shape) for out, (f, _, dtype) in zip(flat, self._fields,
                                                                                           strict=True)}
