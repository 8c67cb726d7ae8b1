"""Integrity of training shards: per-sample checksums and the token-id bound, checked on every read.

Precompute writes, beside each shard ``NNNNN.tar``, a sidecar ``NNNNN.xxh3``: one little-endian uint64
per sample, the xxh3-64 hash (seed 0) of the sample's ``sample_bytes`` bytes as they lie in the tar
(member headers included), and records the sidecar's own xxh3-64 in ``dataset.json`` (``shards[i].sums``)
so a damaged sidecar is caught too. Every reader (the training loader, ``inspect``, ``toolkit data
verify``) hashes each sample it reads and compares: a flipped byte anywhere in a sample fails naming the
shard, the sample's position in it and its id. xxh3 hashes at ~34 GB/s on one core of the 2-core CI
machine (zlib's crc32: 3.2 GB/s, blake2b: 0.7 GB/s), so verifying costs about 1 % of the loader's time
(benchmarks/data/loader_integrity.py).

Token ids are checked against the tokenizer's vocabulary (``dataset.json`` extra ``vocab_size``) once per
read, vectorised: an id outside ``[0, vocab_size)`` would otherwise surface deep inside the text tower as
``IndexError: index out of range in self``, naming nothing.

Datasets precomputed before checksums existed still load: the loader logs one notice that their reads
are not verified (``toolkit data precompute`` again writes the checksums).
"""

from __future__ import annotations

import os
from stat import S_ISREG
from typing import Any

import numpy as np
import xxhash

from toolkit.core import files
from toolkit.core.log import get_logger

ALGORITHM = "xxh3_64"
SUMS_EXT = "xxh3"
SUM_DTYPE = np.dtype("<u8")
# roots already told they carry no checksums (one notice per dataset and process, not one per worker/epoch)
_NOTICED: set[str] = set()
# model name -> vocabulary size, for datasets that predate extra.vocab_size (resolving loads a tokenizer)
_MODEL_VOCAB: dict[str, int | None] = {}


class DataIntegrityError(ValueError):
    """A training shard does not hold what precompute wrote; the message names the shard and sample."""


def sample_hash(data: Any) -> int:
    """xxh3-64 (seed 0) of one sample's bytes (bytes, memoryview or a contiguous uint8 array)."""
    return xxhash.xxh3_64_intdigest(data)


def sums_file(shard_name: str) -> str:
    """``00003.tar`` -> ``00003.xxh3``, the shard's checksum sidecar."""
    return shard_name.rsplit(".", 1)[0] + "." + SUMS_EXT


def encode_sums(sums: list[int]) -> tuple[bytes, str]:
    """Per-sample hashes -> (sidecar bytes, the sidecar's own hash as 16 hex digits for dataset.json)."""
    data = np.asarray(sums, dtype=SUM_DTYPE).tobytes()
    return data, f"{sample_hash(data):016x}"


def load_sums(ds: Any, shard_index: int) -> list[int] | None:
    """The per-sample hashes (num_samples Python ints) of one shard, checked against dataset.json; None for
    a dataset written before checksums (the notice is logged once per dataset). Called by every reader
    process when it opens a shard."""
    shard = ds.shards[shard_index]
    if not shard.sums:
        notice_unverified(ds)
        return None
    url = files.join(ds.root, sums_file(shard.name))
    try:
        with files.open_file(url, "rb") as fh:
            data = fh.read()
    except FileNotFoundError as err:
        raise DataIntegrityError(
            f"{url}: missing (the checksums of {shard.name}); restore it or precompute this dataset again"
        ) from err
    if f"{sample_hash(data):016x}" != shard.sums or len(data) != shard.num_samples * SUM_DTYPE.itemsize:
        raise DataIntegrityError(
            f"{url}: damaged ({len(data)} bytes, hash differs from dataset.json's "
            f"{shard.sums}); restore it or precompute this dataset again"
        )
    return np.frombuffer(data, SUM_DTYPE).tolist()  # ints: comparing numpy scalars costs ~10x more per sample


def notice_unverified(ds: Any) -> None:
    if ds.root not in _NOTICED:
        _NOTICED.add(ds.root)
        get_logger("data").warning(
            "%s: no checksums (precomputed before the toolkit wrote them): reads are not "
            "verified; run `toolkit data precompute` again to add them",
            ds.root,
        )


def check_sums(ds: Any, shard_index: int, start: int, data: Any, sums: list[int] | None) -> None:
    """Raise DataIntegrityError naming the first sample of ``data`` (samples ``start..`` of the shard, as
    [n, sample_bytes] uint8 rows or a flat memoryview of them) whose hash differs from precompute's; nothing
    when ``sums`` is None. A shuffled batch reads runs of about one sample, so this is a plain loop over
    memoryview slices: numpy calls per run cost more than the hashing (a vectorised version made the
    loader 20 % slower per CPU-second at 64 px; hashing numpy row views instead of slices costs 1.3 us
    against 0.6 us a sample)."""
    if sums is None:
        return
    view = data if isinstance(data, memoryview) else memoryview(np.ascontiguousarray(data)).cast("B")
    size, digest = ds.sample_bytes, xxhash.xxh3_64_intdigest
    for k in range(len(view) // size):
        if digest(view[k * size : (k + 1) * size]) != sums[start + k]:
            raise damaged(ds, shard_index, start + k, "its checksum does not match the one precompute wrote")


def damaged(ds: Any, shard_index: int, position: int, why: str) -> DataIntegrityError:
    shard = ds.shards[shard_index]
    return DataIntegrityError(
        f"{ds.url(shard)}: sample {position} (id {shard.first_id + position}) is damaged: {why}; run "
        "`toolkit "
        f"data verify {ds.root}` to list every damaged sample, then restore the shard or precompute again"
    )


def check_tokens(ds: Any, shard_index: int, start: int, tokens: np.ndarray, vocab_size: int | None) -> None:
    """Raise DataIntegrityError naming the first sample of ``tokens`` ([n, L] int32, samples
    ``start..start+n-1`` of the shard) with an id outside ``[0, vocab_size)``; one vectorised pass."""
    if vocab_size is None or tokens.size == 0:
        return
    bad = (tokens < 0) | (tokens >= vocab_size)
    if not bad.any():
        return
    k, pos = (int(i[0]) for i in np.nonzero(bad))
    raise damaged(
        ds,
        shard_index,
        start + k,
        f"token {pos} is {int(tokens[k, pos])}, outside the vocabulary "
        f"[0, {vocab_size}) of the tokenizer it was precomputed with",
    )


def check_batch_tokens(ds: Any, ids: np.ndarray, tokens: np.ndarray, vocab_size: int | None) -> None:
    """:func:`check_tokens` over a whole batch ([B, L] for sample ids ``ids`` [B]): one vectorised pass per
    batch, however the ids fall into shards; the error names the first bad sample's shard and position."""
    if vocab_size is None or tokens.size == 0 or (tokens.min() >= 0 and tokens.max() < vocab_size):
        return
    k = int(np.nonzero(((tokens < 0) | (tokens >= vocab_size)).any(axis=1))[0][0])
    first_ids = np.array([s.first_id for s in ds.shards])
    shard = int(np.searchsorted(first_ids, ids[k], side="right") - 1)
    position = int(ids[k] - first_ids[shard])
    check_tokens(ds, shard, position, tokens[k : k + 1], vocab_size)


def vocab_size(ds: Any) -> int | None:
    """The vocabulary bound of ``ds``'s token ids: dataset.json's ``extra.vocab_size``, or for datasets
    precomputed before it was recorded the vocabulary of the model it names (None if it has no tokens or
    the model cannot be resolved offline). Called once per loader, in the process that builds it."""
    if ds.field("tokens") is None:
        return None
    if ds.extra.get("vocab_size"):
        return int(ds.extra["vocab_size"])
    if ds.model not in _MODEL_VOCAB:
        try:
            from toolkit.models.registry import tokenizer

            _MODEL_VOCAB[ds.model] = tokenizer_vocab_size(tokenizer(ds.model))
        except Exception:  # noqa: BLE001 - a model that no longer resolves only loses the check
            _MODEL_VOCAB[ds.model] = None
    return _MODEL_VOCAB[ds.model]


def tokenizer_vocab_size(tok: Any) -> int:
    """Number of token ids of an open_clip tokenizer (bundled BPE or HF)."""
    if getattr(tok, "vocab_size", None):
        return int(tok.vocab_size)
    return len(tok.tokenizer)


def check_shard_entries(shards: list[Any], path: str) -> None:
    """ValueError naming dataset.json and the key: a shard name that is not a plain file name in the set's
    folder (``../../other/00001.tar`` would be read from elsewhere), a negative count, ids not dense. Called
    by ``TrainDataset.open`` (``shards``: its ShardInfo list)."""
    next_id = 0
    for i, s in enumerate(shards):
        name = str(s.name)
        if not name or "/" in name or "\\" in name or name in (".", "..") or "://" in name:
            raise ValueError(
                f"{path}: shards[{i}].name {name[:80]!r} is not a file name in the set's folder; "
                "shards are read from that folder only: precompute the folder again"
            )
        if not isinstance(s.num_samples, int) or s.num_samples < 0 or s.first_id != next_id:
            raise ValueError(
                f"{path}: shards[{i}]: num_samples {s.num_samples!r}, first_id {s.first_id!r}: "
                f"counts must be >= 0 and ids dense (first_id {next_id} expected)"
            )
        next_id += s.num_samples


def check_claims(ds: Any, part_bytes: int) -> None:
    """ValueError naming dataset.json, the shard's key and its file when a local shard file is too short for
    the samples dataset.json says it holds (``part_bytes`` per sample in a part: the storage mode's
    ``sample_bytes``) (a damaged or edited dataset.json claiming 10**12 samples made the
    trainer allocate per-sample tables of terabytes). One stat per shard; URLs are not checked. Called by the
    trainer's ``open_data`` (``data verify`` reports short shards itself, sample by sample)."""
    if not files.is_local(ds.root):
        return
    path = files.join(ds.root, "dataset.json")
    for i, s in enumerate(ds.shards):
        try:
            st = os.stat(files.local_path(ds.url(s)))
        except OSError:
            continue  # a missing shard: the reader names it when it gets there
        if not S_ISREG(st.st_mode):
            continue  # a FIFO or device: the reader refuses it, naming what it is
        size = st.st_size
        if s.num_samples * part_bytes > size:
            raise ValueError(
                f"{path}: shards[{i}].num_samples says {s.num_samples} samples of {part_bytes} "
                f"bytes, but {ds.url(s)} holds {size} bytes ({size // part_bytes} samples at "
                "most): dataset.json does not describe these files; run `toolkit data verify` or "
                "precompute the folder again"
            )
