"""Writing training shards (the format of ``format.py``): :class:`TrainShardWriter` (pixels mode's tars,
meta sidecars and checksums, written by precompute), :class:`AtomicOut` (a file that appears under its
name only once complete, also used by the table modes' writer).
Called by the precompute process (rank 0 of a distributed precompute) only."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tarfile
from typing import Any

from toolkit.core import files
from toolkit.data.trainset import integrity
from toolkit.data.trainset.format import BLOCK, Field, ShardInfo, id_key, meta_file, shard_file


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    # Fixed metadata so reruns write byte-identical shards.
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = (
        size,
        0,
        0o444,
        0,
        0,
        "",
        "",
    )
    return info


class AtomicOut:
    """A writable binary file that appears at ``path`` only on ``commit()`` (temp + rename locally)."""

    def __init__(self, path: str):
        self.path = path
        self.tmp = f"{files.local_path(path)}.tmp-{os.getpid()}" if files.is_local(path) else None
        self.fh = open(self.tmp, "wb") if self.tmp else files.open_file(path, "wb")

    def commit(self) -> None:
        self.fh.close()
        if self.tmp:
            os.replace(self.tmp, files.local_path(self.path))


class TrainShardWriter:
    """Writes samples in id order into ``samples_per_shard``-sized shards under ``out``.

    Called on the one process that owns ``out``; ``add`` must see ids 0, 1, 2, ... in order.
    """

    def __init__(self, out: str, fields: list[Field], samples_per_shard: int):
        self.out, self.fields, self.samples_per_shard = out, fields, samples_per_shard
        self.shards: list[ShardInfo] = []
        self.next_id = 0
        self._tar: tarfile.TarFile | None = None
        self._files: tuple[AtomicOut, AtomicOut] | None = None
        self._count = 0

    def _open(self) -> None:
        index = len(self.shards)
        tar_out, meta_out = (
            AtomicOut(files.join(self.out, shard_file(index))),
            AtomicOut(files.join(self.out, meta_file(index))),
        )
        self._files = (tar_out, meta_out)
        self._tar = tarfile.open(fileobj=tar_out.fh, mode="w", format=tarfile.USTAR_FORMAT)
        self._count, self._first, self._sums = 0, self.next_id, []

    def _close_shard(self) -> None:
        assert self._tar is not None and self._files is not None
        self._tar.close()
        index = len(self.shards)
        data, digest = integrity.encode_sums(self._sums)
        sums_out = AtomicOut(files.join(self.out, integrity.sums_file(shard_file(index))))
        sums_out.fh.write(data)
        for f in (*self._files, sums_out):  # the tar last-but-one, the sidecar last: both before dataset.json
            f.commit()
        self.shards.append(ShardInfo(shard_file(index), self._count, self._first, digest))
        self._tar, self._files = None, None

    def add(self, sample_id: int, payloads: list[bytes], meta: dict[str, Any]) -> None:
        """Append one sample; ``payloads`` are the fields' raw bytes in ``fields`` order."""
        if sample_id != self.next_id:
            raise ValueError(f"sample ids must be added in order: got {sample_id}, expected {self.next_id}")
        if self._tar is None:
            self._open()
        key = id_key(sample_id)
        sample = bytearray()  # the sample's bytes exactly as the tar holds them, for its checksum
        for f, data in zip(self.fields, payloads, strict=True):
            if len(data) != f.nbytes:
                raise ValueError(f"sample {sample_id} field {f.ext}: {len(data)} bytes, expected {f.nbytes}")
            info = _tarinfo(f"{key}.{f.ext}", len(data))
            sample += info.tobuf(tarfile.USTAR_FORMAT, self._tar.encoding, self._tar.errors)
            sample += data
            sample += bytes(f.padded_bytes - BLOCK - len(data))
            self._tar.addfile(info, io.BytesIO(data))
        self._sums.append(integrity.sample_hash(sample))
        self._files[1].fh.write((json.dumps({"id": sample_id, **meta}, ensure_ascii=False) + "\n").encode())
        self.next_id += 1
        self._count += 1
        if self._count == self.samples_per_shard:
            self._close_shard()

    def close(self) -> list[ShardInfo]:
        if self._tar is not None:
            self._close_shard()
        return self.shards

    def discard(self) -> str | None:
        """After a failed write (a full disk): delete the shard being written, so that its space is free for
        the manifest that records the failure; returns its path (None if no shard was open)."""
        if self._files is None:
            return None
        for f in self._files:
            with contextlib.suppress(OSError):
                f.fh.close()
            if f.tmp:
                with contextlib.suppress(OSError):
                    os.unlink(f.tmp)
        path, self._tar, self._files = self._files[0].path, None, None
        return path
