"""Table modes (``jpeg``, ``index`` and any mode built on :class:`TableMode`): a table of byte ranges into
image files, decoded by the loader.

``pixels`` (:mod:`.pixels`) stores fixed-size decoded samples. The table modes store, per training part
``NNNNN``, a table ``NNNNN.idx`` of fixed-size little-endian records (``format.ref_dtype``, 24 + 4 L bytes):

==========  =======  ===========================================================================
field       dtype    meaning
==========  =======  ===========================================================================
``file``    uint32   index into ``dataset.json``'s ``data_files``: the file holding the image bytes
``length``  uint32   byte length of the encoded image
``offset``  uint64   byte offset of the encoded image in that file
``hash``    uint64   xxh3-64 (seed 0) of those ``length`` bytes, checked on every read
``tokens``  int32    [L] caption token ids (as in pixels mode)
``ref_*``   float16  [D_ref] each: ``ref_image``, ``ref_text``, a reference model's embeddings (only in
                     sets precomputed with ``--reference-model``, :mod:`.reference`)
==========  =======  ===========================================================================

Record k of part p is global sample ``shards[p].first_id + k``; the table's own xxh3-64 is
``shards[p].sums`` in ``dataset.json``, checked whenever a reader loads a table.

- ``index``: no copy. ``data_files`` are the user's raw webdataset tars and each record points at the
  image member's data inside them (the loader seeks there and decodes + resizes like precompute did).
- ``jpeg``: images re-encoded at the model's resolution (``jpeg_quality``) and concatenated into
  ``NNNNN.jpgs`` beside the table, one per part; ``data_files`` are those names. A mode that re-encodes
  otherwise (:class:`EncodedMode`) names its own per-part data file suffix.

``data_root`` (``dataset.json``) is where ``data_files`` live: relative to the dataset folder when it does
not start with ``/`` or a URL scheme (``"."`` for jpeg, ``"../raw"`` for an index written next to its raw
shards), so a folder pair moved or served together (``https://host/sets/idx`` with ``../raw``) still works.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterator
from typing import Any

import numpy as np
import xxhash

from toolkit.core import files
from toolkit.data.trainset import integrity
from toolkit.data.trainset.format import ShardInfo, meta_file, ref_dtype, shard_file
from toolkit.data.trainset.writer import AtomicOut

TABLE_EXT = "idx"


def table_file(index: int) -> str:
    return shard_file(index)[: -len("tar")] + TABLE_EXT


def data_file(index: int, ext: str) -> str:
    """Part ``index``'s own data file (jpeg: ``NNNNN.jpgs``)."""
    return shard_file(index)[: -len("tar")] + ext


def resolve_data_root(root: str, data_root: str) -> str:
    """Where ``data_files`` live: ``data_root`` itself if absolute or a URL, else joined to ``root`` and
    normalised (``s3://b/sets/idx`` + ``../raw`` -> ``s3://b/sets/raw``)."""
    if "://" in data_root or data_root.startswith("/"):
        return data_root.rstrip("/")
    scheme, sep, path = str(root).rpartition("://")
    joined = posixpath.normpath(posixpath.join(path or ".", data_root))
    return f"{scheme}{sep}{joined}" if sep else joined


def relative_data_root(out: str, data_dir: str) -> str:
    """``data_dir`` as stored in dataset.json: relative to ``out`` when both are local paths; an absolute
    path for local shards indexed into a remote ``out``; else the URL as given."""
    if files.is_local(data_dir):
        local = os.path.abspath(files.local_path(data_dir))
        return (
            os.path.relpath(local, os.path.abspath(files.local_path(out))) if files.is_local(out) else local
        )
    return data_dir.rstrip("/")


def load_table(ds: Any, part: int) -> np.ndarray:
    """The records of part ``part`` (a read-only structured array; memory-mapped for a local file), checked
    against dataset.json's hash; DataIntegrityError naming the file otherwise. Called by every reader
    process when it first touches a part: a process that touches every part keeps 24 + 4 L bytes a sample
    of them (page cache for local sets, process memory for remote ones)."""
    shard = ds.shards[part]
    url = ds.url(shard)
    try:
        if files.is_local(url):  # mapped: the page cache holds tables once for every loader worker, evictable
            path = files.local_path(url)
            data = np.memmap(path, np.uint8, "r") if os.path.getsize(path) else b""
        else:
            with files.open_file(url, "rb") as fh:
                data = fh.read()
    except TimeoutError as err:  # fsspec's FSTimeoutError has no text at all
        raise TimeoutError(
            f"{url}: no answer within {files.HTTP_TIMEOUT_S:g} s (CLIPTK_HTTP_TIMEOUT_S) while reading "
            f"part {part}'s table: the server stopped answering"
        ) from err
    except FileNotFoundError as err:
        raise integrity.DataIntegrityError(
            f"{url}: missing (part {part} of {len(ds.shards)} in dataset.json); "
            "restore it or precompute this dataset again"
        ) from err
    dtype = ds.table_dtype
    if (
        len(data) != shard.num_samples * dtype.itemsize
        or f"{xxhash.xxh3_64_intdigest(memoryview(data)):016x}" != shard.sums
    ):
        raise integrity.DataIntegrityError(
            f"{url}: damaged ({len(data)} bytes, hash differs from dataset.json's "
            f"{shard.sums}); restore it or precompute this dataset again"
        )
    return np.frombuffer(data, dtype)


# What a record whose bytes changed says (verify counts these per data file: all of a file's records failing
# means the file is another one than was indexed).
CHECKSUM_MISMATCH = "their checksum does not match the index's"


def decode_image(data: bytes, side: int, resize_mode: str) -> np.ndarray:
    """Encoded image bytes -> uint8 [side, side, 3], exactly as precompute's pixels mode would store it.

    The one place the loader decodes: point it at a faster decoder here (same output contract)."""
    from toolkit.data.images import decode_rgb

    return decode_rgb(data, side, resize_mode)[0]


def damaged_ref(
    ds: Any, part: int, position: int, url: str, rec: Any, why: str
) -> integrity.DataIntegrityError:
    shard = ds.shards[part]
    return integrity.DataIntegrityError(
        f"{url}: bytes {int(rec['offset'])}..{int(rec['offset']) + int(rec['length'])} of sample {position} "
        "of "
        f"{shard.name} (id {shard.first_id + position}) are damaged: {why}; run `toolkit data verify "
        f"{ds.root}` "
        "to list every damaged sample"
    )


class RefReader:
    """Reads arbitrary sample ids of a jpeg/index dataset into stacked arrays ({'image': uint8 [n, S, S, 3],
    'tokens': int32 [n, L]}, and 'ref_image', 'ref_text' float16 [n, D_ref] with a reference); one per process
    (each DataLoader worker makes its own). Tables are loaded and checked once per part; data files stay open
    (at most ``max_open``)."""

    def __init__(self, ds: Any, vocab_size: int | None = None, max_open: int = 64):
        self.ds, self.vocab_size, self.max_open = ds, vocab_size, max_open
        self.first_ids = np.array([s.first_id for s in ds.shards], dtype=np.int64)
        self.side = ds.field("image").shape[0]
        self.resize_mode = ds.extra.get("resize_mode", "center_crop")
        self.data_root = resolve_data_root(ds.root, ds.data_root)
        self._tables: dict[int, np.ndarray] = {}
        self._open: dict[int, Any] = {}

    def table(self, part: int) -> np.ndarray:
        if part not in self._tables:
            self._tables[part] = load_table(self.ds, part)
        return self._tables[part]

    def data_url(self, file: int) -> str:
        return files.join(self.data_root, self.ds.data_files[file])

    def _file(self, file: int):
        if file not in self._open:
            if len(self._open) >= self.max_open:
                self._open.pop(next(iter(self._open))).close()
            url = self.data_url(file)
            try:  # remote: each read one range request of exactly the image
                self._open[file] = files.open_ranges(url)
            except FileNotFoundError as err:
                if (cause := files.network_cause(err)) is not None:  # the server is gone, not the file
                    raise files.unreachable(url, cause) from err
                raise integrity.DataIntegrityError(
                    f"{url}: missing (data file {file} of {self.ds.root}); restore it, or keep the data "
                    "next to "
                    f"the dataset as data_root {self.ds.data_root!r} says"
                ) from err
        return self._open[file]

    def image_bytes(self, part: int, position: int, rec: Any) -> bytes:
        """The checked encoded bytes of record ``rec`` (sample ``position`` of part ``part``); TimeoutError
        naming the URL and the sample when a server stops answering (``files.HTTP_TIMEOUT_S``)."""
        url = self.data_url(int(rec["file"]))
        try:
            fh = self._file(int(rec["file"]))
            fh.seek(int(rec["offset"]))
            data = fh.read(int(rec["length"]))
        except TimeoutError as err:  # fsspec's FSTimeoutError has no text at all
            shard = self.ds.shards[part]
            raise TimeoutError(
                f"{url}: no answer within {files.HTTP_TIMEOUT_S:g} s (CLIPTK_HTTP_TIMEOUT_S) while "
                f"reading sample {position} of {shard.name} (id {shard.first_id + position}): the "
                "server stopped answering"
            ) from err
        if len(data) != int(rec["length"]):
            raise damaged_ref(self.ds, part, position, url, rec, f"the file ends after {len(data)} of them")
        if xxhash.xxh3_64_intdigest(data) != int(rec["hash"]):
            raise damaged_ref(self.ds, part, position, url, rec, CHECKSUM_MISMATCH)
        return data

    def read(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """{role: array [len(ids), *shape]} for ``ids`` (int64, any order, returned in that order); each
        image's bytes are hash-checked, then decoded (:func:`decode_image`); reads go in file-offset order."""
        if ids.size and (ids.min() < 0 or ids.max() >= self.ds.num_samples):
            raise IndexError(
                f"{self.ds.root}: sample ids must lie in [0, {self.ds.num_samples}), got "
                f"{int(ids.min())}..{int(ids.max())}"
            )
        parts = np.searchsorted(self.first_ids, ids, side="right") - 1
        recs = [
            (int(p), int(i - self.first_ids[p]), self.table(int(p))[int(i - self.first_ids[p])])
            for p, i in zip(parts, ids, strict=True)
        ]
        images = np.empty((len(ids), self.side, self.side, 3), np.uint8)
        for k in sorted(range(len(recs)), key=lambda k: (int(recs[k][2]["file"]), int(recs[k][2]["offset"]))):
            part, position, rec = recs[k]
            data = self.image_bytes(part, position, rec)
            try:
                images[k] = decode_image(data, self.side, self.resize_mode)
            except ValueError as err:  # ImageError included: bytes precompute decoded no longer decode
                raise damaged_ref(
                    self.ds,
                    part,
                    position,
                    self.data_url(int(rec["file"])),
                    rec,
                    f"they do not decode ({err})",
                ) from err
        columns = {"tokens": "tokens"} | {
            r: r for r in ("ref_image", "ref_text") if self.ds.field(r) is not None
        }
        out = {"image": images}
        for role, column in columns.items():
            dtype = self.ds.table_dtype[column]
            out[role] = (
                np.stack([r[2][column] for r in recs]) if recs else np.zeros((0, *dtype.shape), dtype.base)
            )
        integrity.check_batch_tokens(self.ds, ids, out["tokens"], self.vocab_size)
        return out

    def close(self) -> None:
        for fh in self._open.values():
            fh.close()
        self._open.clear()


def iter_segment(ds: Any, part: int, start: int, count: int, valid: bool = True) -> Iterator[dict[str, Any]]:
    """Samples ``start..start+count-1`` of part ``part`` as dicts {role: array, 'index': id, 'valid': bool}
    (what :func:`toolkit.data.trainset.segment.read_segment` yields for pixels)."""
    reader = RefReader(ds, integrity.vocab_size(ds))
    try:
        first = ds.shards[part].first_id
        for k in range(start, start + count):
            out = {role: v[0] for role, v in reader.read(np.array([first + k], np.int64)).items()}
            out["index"], out["valid"] = first + k, valid
            yield out
    finally:
        reader.close()


class RefShardWriter:
    """Writes jpeg/index parts (``NNNNN.idx`` + ``NNNNN.meta.jsonl``, + ``NNNNN.jpgs`` for jpeg) of
    ``samples_per_shard`` samples under ``out``; ``add`` sees ids 0, 1, 2, ... in order. Called on the one
    process that owns ``out``; returns the parts' ShardInfo from :meth:`close`."""

    def __init__(
        self, out: str, data_ext: str, context_length: int, samples_per_shard: int, ref_dim: int = 0
    ):
        """``data_ext``: suffix of each part's own data file (jpeg: ``jpgs``); "" for data files elsewhere."""
        self.out, self.data_ext, self.samples_per_shard = out, data_ext, samples_per_shard
        self.dtype = ref_dtype(context_length, ref_dim)
        self.shards: list = []
        self.data_files: list[str] = []  # jpeg: the parts' .jpgs names (their data files)
        self.next_id = 0
        self._part: dict[str, Any] | None = None

    def _open(self) -> None:
        index = len(self.shards)
        self._part = {
            "first": self.next_id,
            "records": [],
            "meta": AtomicOut(files.join(self.out, meta_file(index))),
            "jpgs": AtomicOut(files.join(self.out, data_file(index, self.data_ext)))
            if self.data_ext
            else None,
            "size": 0,
        }

    def add(
        self,
        sample_id: int,
        file: int,
        offset: int,
        length: int,
        digest: int,
        tokens: np.ndarray,
        meta: dict[str, Any],
        data: bytes | None = None,
        reference: tuple = (),
    ) -> None:
        """Append one sample: its image is ``length`` bytes at ``offset`` of data file ``file`` (index), or
        ``data`` (jpeg: appended to this part's .jpgs); ``digest`` is their xxh3-64; ``reference``: its
        (ref_image, ref_text) float16 [D_ref] rows when the set has a reference model."""
        import json

        if sample_id != self.next_id:
            raise ValueError(f"sample ids must be added in order: got {sample_id}, expected {self.next_id}")
        if self._part is None:
            self._open()
        part = self._part
        if data is not None:
            if len(data) != length or xxhash.xxh3_64_intdigest(data) != digest:
                raise RuntimeError(
                    f"sample {sample_id}: re-encoded JPEG scratch bytes changed since they were "
                    "written (damaged scratch folder?); run precompute again"
                )
            file, offset = len(self.shards), part["size"]
            part["jpgs"].fh.write(data)
            part["size"] += length
        part["records"].append((file, length, offset, digest, tokens, *reference))
        part["meta"].fh.write((json.dumps({"id": sample_id, **meta}, ensure_ascii=False) + "\n").encode())
        self.next_id += 1
        if len(part["records"]) == self.samples_per_shard:
            self._close_part()

    def _close_part(self) -> None:
        part, index = self._part, len(self.shards)
        table = np.array(part["records"], self.dtype).tobytes()
        out = AtomicOut(files.join(self.out, table_file(index)))
        out.fh.write(table)
        for f in (part["jpgs"], part["meta"], out):  # the table last: it names the bytes the others hold
            if f is not None:
                f.commit()
        if part["jpgs"] is not None:
            self.data_files.append(data_file(index, self.data_ext))
        self.shards.append(
            ShardInfo(
                table_file(index),
                len(part["records"]),
                part["first"],
                f"{xxhash.xxh3_64_intdigest(table):016x}",
            )
        )
        self._part = None

    def close(self) -> list:
        if self._part is not None:
            self._close_part()
        return self.shards
