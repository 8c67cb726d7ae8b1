"""Second half of ``precompute``: dense ids over every processed raw shard, then the training shards/tables.

Ids follow (raw shard in sorted order, key in sorted order); a key already kept from an earlier raw shard is
skipped as ``duplicate_key``. The parent streams: it holds one raw shard's keys and captions at a time, and
for the whole set only a 64-bit hash per kept key (``<stem>.khash``, written by the workers), sorted in place
to find the few hashes that occur more than once; only keys with such a hash are compared as strings (a
dict of those keys). That is 8 bytes per sample, where the ids used to
need ~220 bytes per sample of Python lists, tuples and a key -> shard dict.
All functions run in the parent process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import numpy as np

from toolkit.core.log import progress
from toolkit.data.raw.reader import shard_names, split_common_dir
from toolkit.data.trainset import precompute_worker, reference, refs
from toolkit.data.trainset.format import Field
from toolkit.data.trainset.precompute_resume import stem_of
from toolkit.data.trainset.precompute_worker import ShardResult, scratch_paths
from toolkit.data.trainset.writer import TrainShardWriter

# Hashes compared per numpy call when looking for repeats: bounds the comparison's scratch memory.
CHUNK = 1 << 20


def repeated_key_hashes(results: list[ShardResult]) -> np.ndarray:
    """The sorted distinct 64-bit key hashes that occur more than once over all ``results``."""
    hashes = np.empty(sum(r.num_kept for r in results), "<u8")
    pos = 0
    for res in results:
        if res.num_kept:
            hashes[pos:pos + res.num_kept] = np.fromfile(scratch_paths(stem_of(res))["khash"], "<u8")
            pos += res.num_kept
    hashes.sort()  # in place: no second copy of the N hashes
    found = []
    for lo in range(1, len(hashes), CHUNK):  # chunked: a whole-array comparison would add 1 byte a sample
        cur = hashes[lo:lo + CHUNK]
        found.append(cur[cur == hashes[lo - 1:lo - 1 + len(cur)]])
    return np.unique(np.concatenate(found)) if found else np.zeros(0, "<u8")


def kept_samples(results: list[ShardResult], skips: list[dict]) -> Iterator[tuple[ShardResult, int, str, str]]:
    """(result, row, key, caption) of every kept sample in id order; appends every skip record to
    ``skips`` as it goes (a shard's worker skips, then its duplicate keys), in the order of skipped.jsonl."""
    repeated = repeated_key_hashes(results)
    owners: dict[int, dict[str, str]] = {}  # a repeated hash -> {key: raw shard that kept it}
    names = shard_names([r.url for r in results])
    for res in results:
        name = names[res.url]
        skips.extend({"reason": r, "shard": name, "key": k, "message": m} for r, k, m in res.skips)
        if not res.num_kept:
            continue
        paths = scratch_paths(stem_of(res))
        with open(paths["keys"], encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh]
        khash = np.fromfile(paths["khash"], "<u8")
        maybe = np.isin(khash, repeated)
        for row, digest, check in zip(np.fromfile(paths["order"], "<u4").tolist(), khash.tolist(), maybe.tolist(),
                                      strict=True):
            key, caption = rows[row]
            if check:
                seen = owners.setdefault(digest, {})
                if key in seen:
                    skips.append({"reason": "duplicate_key", "shard": name, "key": key,
                                  "message": f"key already kept from {seen[key]}"})
                    continue
                seen[key] = name
            yield res, row, key, caption


def _rows(path: str, field: Field, count: int) -> np.ndarray:
    """Scratch file of ``count`` fixed-size rows -> uint8 memmap [count, field.nbytes]."""
    if count == 0:
        return np.zeros((0, field.nbytes), np.uint8)
    size = os.path.getsize(path)
    if size != count * field.nbytes:
        raise RuntimeError(f"{path}: {size} bytes, expected {count} rows of {field.nbytes}")
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(count, field.nbytes))


def scratch_fields(storage: str, fields: list[Field]) -> list[Field]:
    """The fixed-size rows of the workers' scratch files: the image and text fields, or for jpeg/index a
    (offset, length, hash) row per image (precompute_worker.REF_ROW) instead of its pixels; then with a
    reference model one row of both its embeddings (``<stem>.ref``, :func:`reference.scratch_field`)."""
    tail = [reference.scratch_field(fields[2].shape[0])] if len(fields) > 2 else []
    if storage == "pixels":
        return [*fields[:2], *tail]
    return [Field("image", "ref", "uint8", (precompute_worker.REF_ROW.itemsize,)), fields[1], *tail]


def _scratch_rows(res: ShardResult, scratch: list[Field]) -> list[np.ndarray]:
    """A processed raw shard's scratch files as uint8 rows [num_kept, nbytes], in ``scratch`` order."""
    paths = (res.image_path, res.text_path, stem_of(res) + reference.SCRATCH_EXT)
    return [_rows(path, f, res.num_kept) for path, f in zip(paths, scratch, strict=False)]


def _samples(results: list[ShardResult], skips: list[dict], desc: str):
    return progress(kept_samples(results, skips), total=sum(r.num_kept for r in results), desc=desc,
                    unit="samples")


def write_pixels(cfg, fields: list[Field], results: list[ShardResult], urls: list[str],
                 skips: list[dict]) -> tuple[list, str, list[str]]:
    """Pixels (or frozen-feature) training shards; returns (shards, data_root "", data_files [])."""
    writer = TrainShardWriter(cfg.out, fields, cfg.samples_per_shard)
    scratch = scratch_fields("pixels", fields)
    current, rows = None, []
    names = shard_names(urls)
    try:
        for sample_id, (res, row, key, caption) in enumerate(_samples(results, skips, "write shards")):
            if res is not current:  # results arrive in order: one shard's memmaps open at a time
                current, rows = res, _scratch_rows(res, scratch)
            payloads = [rows[0][row].tobytes(), rows[1][row].tobytes()]
            if len(rows) > 2:  # ref_image, ref_text
                payloads += reference.split_row(rows[2][row], fields[2].shape[0])
            writer.add(sample_id, payloads, {"caption": caption, "source": names[res.url], "key": key})
        return writer.close(), "", []
    except OSError as err:  # a full disk: name the shard and free its space for the failed manifest
        shard = writer.discard()
        raise OSError(err.errno, f"{err.strerror or err} while writing the training shard {shard or cfg.out} "
                                 f"(into --out {cfg.out}); free space there and rerun (processed raw shards are "
                                 "kept)") from err


def write_refs(cfg, fields: list[Field], results: list[ShardResult], urls: list[str],
               skips: list[dict]) -> tuple[list, str, list[str]]:
    """jpeg/index parts (refs.RefShardWriter); returns (parts, data_root, data_files) for dataset.json.
    index: data files are the raw shards, named relative to their common folder, itself stored relative to
    OUT when both are local (refs.relative_data_root)."""
    scratch = scratch_fields(cfg.storage, fields)
    ref_dim = fields[2].shape[0] if len(fields) > 2 else 0
    writer = refs.RefShardWriter(cfg.out, cfg.storage, scratch[1].shape[0], cfg.samples_per_shard, ref_dim)
    current, jpg, embeddings = None, None, None
    names = shard_names(urls)
    try:
        for sample_id, (res, row, key, caption) in enumerate(_samples(results, skips, "write tables")):
            if res is not current:  # results arrive in order: one shard's scratch open at a time
                current = res
                if jpg is not None:
                    jpg.close()
                jpg = open(stem_of(res) + ".jpg", "rb") if cfg.storage == "jpeg" else None
                rows = _scratch_rows(res, scratch)
                ref_rows, texts = rows[0].view(precompute_worker.REF_ROW)[:, 0], rows[1].view("<i4")
                embeddings = rows[2].view("<f2").reshape(-1, 2, ref_dim) if ref_dim else None
            offset, length, digest = (int(ref_rows[row][k]) for k in ("offset", "length", "hash"))
            data = None
            if jpg is not None:
                jpg.seek(offset)
                data = jpg.read(length)
            writer.add(sample_id, res.index, offset, length, digest, texts[row],
                       {"caption": caption, "source": names[res.url], "key": key}, data,
                       tuple(embeddings[row]) if ref_dim else ())
    finally:
        if jpg is not None:
            jpg.close()
    shards = writer.close()
    if cfg.storage == "jpeg":
        return shards, ".", writer.data_files
    root, names = split_common_dir(urls)
    return shards, refs.relative_data_root(cfg.out, root), names
