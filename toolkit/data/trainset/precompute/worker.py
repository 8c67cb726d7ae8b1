"""Per-raw-shard work of ``precompute``, run in its worker processes (:mod:`toolkit.core.forkpool`) or inline.

:func:`process_shard` reads one raw shard, validates captions, decodes and resizes images (or runs a
frozen tower on them), tokenizes captions (or runs a frozen text tower) and appends each kept
sample's field bytes to temporary files (the image rows as the storage mode makes them). It returns a
small :class:`ShardResult` (counts, skips); the parent assigns global ids and writes the training shards.

The tokenizer, towers and storage mode come in the :class:`~.job.Job` each call is handed: the parent
loads them once before its workers fork, and the workers share them copy-on-write.
"""

from __future__ import annotations

import errno
import functools
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from toolkit.data.images import ImageError, decode_rgb
from toolkit.data.raw.captions import caption_of, members_hint
from toolkit.data.raw.reader import RawSample, RawShardReader, expected_keys, shard_basename

# Frozen-tower forward passes and tokenization run over this many samples at a time.
ENCODE_BATCH = 64


@dataclass(frozen=True)
class ShardTask:
    """One raw shard to process: its index in sorted-URL order, URL, and the prefix of its scratch files
    (``stem + '.image'``, ``'.text'``, ...); everything common to all shards is in the job."""

    index: int
    url: str
    stem: str


@dataclass
class ShardResult:
    """Outcome of one raw shard; its kept samples' rows are in scratch files (:func:`scratch_paths`), so the
    parent holds no per-sample data (keys, captions) for the shards it waits on."""

    index: int
    url: str
    num_kept: int = 0  # rows of the scratch files; their keys and captions are in '<stem>.keys.jsonl'
    image_path: str = ""
    text_path: str = ""
    num_read: int = 0
    skips: list[tuple[str, str, str]] = field(default_factory=list)  # (reason, key, message)
    converted: Counter = field(default_factory=Counter)
    tar_error: str | None = None
    reference_s: float = (
        0.0  # seconds this shard's reference pass took in its worker (precompute --reference-model)
    )
    num_captions_cut: int = 0  # kept captions longer than the context: their tokens past it are not stored


class _FieldSink:
    """Appends encoded rows to a binary temp file, batching rows through a frozen tower if any."""

    def __init__(self, path: str, encode=None):
        self.path, self.encode, self.pending = path, encode, []
        self.fh = open(path, "wb")

    def add(self, row: Any) -> None:
        if self.encode is None:
            self.fh.write(row)
            return
        self.pending.append(row)
        if len(self.pending) >= ENCODE_BATCH:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            feats = self.encode(self.pending)
            self.fh.write(np.ascontiguousarray(feats, dtype="<f2").tobytes())
            self.pending = []

    def close(self) -> None:
        self.flush()
        self.fh.close()


def _encode_images(tower: Any, rows: list[np.ndarray]) -> np.ndarray:
    return tower.encode(np.stack(rows))


def _write_text(job: Any, path: str, captions: list[str]) -> int:
    """Tokens (int32 little-endian) or frozen text features (float16) for ``captions``, in order; returns how
    many captions the tokenizer cut at the context length (0 with a text tower, whose cut is its own)."""
    num_cut = 0
    with open(path, "wb") as fh:
        for start in range(0, len(captions), ENCODE_BATCH):
            chunk = captions[start : start + ENCODE_BATCH]
            if job.text_tower is not None:
                fh.write(np.ascontiguousarray(job.text_tower.encode(chunk), dtype="<f2").tobytes())
            else:
                tokens = job.tokenizer(chunk)
                num_cut += count_cut(job, chunk, tokens)
                fh.write(np.ascontiguousarray(tokens.numpy(), dtype="<i4").tobytes())
    return num_cut


def count_cut(job: Any, chunk: list[str], tokens) -> int:
    """Captions of ``chunk`` longer than the context that gave ``tokens`` [n, L]. Only full rows (not ending
    in padding: cut, or exactly L tokens) can be; they are tokenized one position longer, and a cut one's
    first L tokens differ (its end-of-text token was put over its L-th token), whatever the tokenizer pads
    with. A tokenizer without a ``context_length`` argument: every full row counts."""
    length = tokens.shape[1]
    full = (tokens[:, -1] != job.pad_token).nonzero().flatten().tolist()
    if not full:
        return 0
    try:
        longer = job.tokenizer([chunk[i] for i in full], context_length=length + 1)
    except TypeError:
        return len(full)
    return int((longer[:, :length] != tokens[full]).any(dim=1).sum())


def _missing_after_read(task: ShardTask, reader: RawShardReader, seen: set[str], res: ShardResult) -> None:
    """Count samples the shard's parquet/stats promise but the tar did not deliver."""
    reason = reader.error_kind or "missing_from_tar"
    keys, count = expected_keys(task.url)
    if keys is not None:
        for key in (k for k in keys if k not in seen):
            res.skips.append((reason, key, "listed as a success in the shard's parquet, not in the tar"))
    elif count is not None and count > len(seen):
        for i in range(count - len(seen)):
            res.skips.append(
                (
                    reason,
                    f"<unknown {i + 1}>",
                    f"_stats.json counts {count} successes, the tar holds {len(seen)} samples",
                )
            )


def process_shard(job: Any, task: ShardTask, on_read=None) -> ShardResult:
    """Process one raw shard of ``job`` into scratch files at ``task.stem``; see the module docstring.
    ``on_read(n)``: called with 1 after each sample read from the tar (progress in samples)."""
    try:
        return _process(job, task, on_read or (lambda _n: None))
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):  # the scratch folder is full, not the raw shard damaged
            folder = os.path.dirname(task.stem)
            raise RuntimeError(
                f"the scratch folder {folder} is full ({err.strerror}) while processing "
                f"{task.url}: free space there or choose another with tmp_dir"
            ) from err
        raise RuntimeError(f"{task.url}: {type(err).__name__}: {err}") from err
    except Exception as err:  # anything unexpected: fail the stage, naming the shard
        raise RuntimeError(f"{task.url}: {type(err).__name__}: {err}") from err


def scratch_paths(stem: str) -> dict[str, str]:
    """A processed raw shard's scratch files besides the row files: ``keys`` (a JSON line [key, caption] per
    row), ``order`` (uint32 rows in sorted-key order) and ``khash`` (uint64 xxh3-64 of each key, in that
    order: all the parent holds per sample to find keys repeated across shards)."""
    return {"keys": stem + ".keys.jsonl", "order": stem + ".order", "khash": stem + ".khash"}


def key_hash(key: str) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogatepass"))


def write_keys(stem: str, keys: list[str], captions: list[str]) -> None:
    import json

    paths = scratch_paths(stem)
    with open(paths["keys"], "w", encoding="utf-8") as fh:
        fh.writelines(
            json.dumps([k, c], ensure_ascii=False) + "\n" for k, c in zip(keys, captions, strict=True)
        )
    order = sorted(range(len(keys)), key=keys.__getitem__)
    np.asarray(order, "<u4").tofile(paths["order"])
    np.asarray([key_hash(keys[r]) for r in order], "<u8").tofile(paths["khash"])


def _reference_sink(job: Any, task: ShardTask):
    """The reference model's row writer for this raw shard (None without ``--reference-model``)."""
    if job.reference is None:
        return None
    from toolkit.data.trainset.reference import ReferenceSink

    return ReferenceSink(job.reference, task.stem, ENCODE_BATCH, job.cfg.max_image_pixels)


def _repeat_message(task: ShardTask, sample: RawSample, partial: set[str]) -> str:
    """Why a key read again within one tar is skipped; when its first sample lacked a member, the tar lists a
    sample's files apart (``tar cf s.tar *.jpg *.txt``), and webdataset groups only consecutive members."""
    message = f"key repeats within {shard_basename(task.url)}"
    if sample.key in partial:
        message += (
            f" (this time with {', '.join(sorted(sample.files))}; its earlier members lacked them): a "
            "sample's "
            "files must follow each other in the tar, as webdataset reads them; write the tar in name order"
        )
    return message


def _read_sample(cfg: Any, sample: RawSample, size: int) -> tuple:
    """(caption, (ext, bytes) of the image, pixels [size, size, 3] uint8, converted mode or None, None), or a
    skip's (reason, message) last with the others None: one raw sample checked and decoded as precompute keeps
    it."""
    caption, problem = caption_of(sample, cfg.caption_ext)
    image = sample.image()
    if problem is None and image is None:
        problem = ("missing_image", f"no image member{members_hint(sample)}")
    if problem is not None:
        return None, None, None, None, problem
    try:
        pixels, converted = decode_rgb(image[1], size, cfg.resize_mode, cfg.max_image_pixels)
    except ImageError as err:
        return None, None, None, None, (err.reason, f".{image[0]}: {err}")
    return caption, image, pixels, converted, None


def _process(job: Any, task: ShardTask, on_read) -> ShardResult:
    res, keys, captions = ShardResult(task.index, task.url), [], []
    res.image_path, res.text_path = task.stem + ".image", task.stem + ".text"
    tower = job.image_tower
    sink = _FieldSink(res.image_path, functools.partial(_encode_images, tower) if tower is not None else None)
    size = tower.image_size if tower is not None else job.image_side
    reader = RawShardReader(task.url, job.cfg.caption_ext)
    seen, partial = set(), set()  # partial: keys skipped for a missing member
    rows = job.mode.image_rows(
        job, task.stem, task.url
    )  # the storage mode's image rows (pixels, jpeg, index...)
    ref = _reference_sink(job, task)
    for sample in reader.samples():
        res.num_read += 1
        on_read(1)
        if sample.key in seen:
            res.skips.append(("duplicate_key", sample.key, _repeat_message(task, sample, partial)))
            continue
        seen.add(sample.key)
        caption, image, pixels, converted, problem = _read_sample(job.cfg, sample, size)
        if problem is not None:
            res.skips.append((problem[0], sample.key, problem[1]))
            if problem[0] in ("missing_image", "missing_caption"):
                partial.add(sample.key)
            continue
        if converted:
            res.converted[converted] += 1
        sink.add(pixels if tower is not None else rows.row(sample, image[0], image[1], pixels))
        if ref is not None:  # the reference decodes the raw bytes itself, through its own transform
            ref.add(image[1])
        keys.append(sample.key)
        captions.append(caption)
    sink.close()
    rows.close()
    _finish_counts(task, reader, seen, res)
    res.num_captions_cut = _write_text(job, res.text_path, captions)
    if ref is not None:
        ref.close(captions)
        res.reference_s = round(ref.seconds, 3)
    write_keys(task.stem, keys, captions)  # after the row files: resume checks the rows against its count
    res.num_kept = len(keys)
    if keys:
        rows.check(res.image_path)
    return res


def _finish_counts(task: ShardTask, reader: RawShardReader, seen: set[str], res: ShardResult) -> None:
    """After the tar's last sample: a cut sample, the tar's error, and samples its sidecars promise."""
    if reader.cut_key is not None:
        res.num_read += 1
        seen.add(reader.cut_key)
        res.skips.append(("truncated_tar", reader.cut_key, reader.error or "cut by the end of the tar"))
    res.tar_error = reader.error
    before = len(res.skips)
    _missing_after_read(task, reader, seen, res)
    if reader.error_kind == "unreadable_tar" and len(res.skips) == before:
        res.skips.append(("unreadable_tar", "*", f"{reader.error} (sample count unknown)"))
    res.num_read += len(res.skips) - before
