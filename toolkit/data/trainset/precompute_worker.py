"""Per-raw-shard work of ``precompute``, run in pool worker processes (or inline with one worker).

:func:`process_shard` reads one raw shard, validates captions, decodes and resizes images (or runs a
frozen tower on them), tokenizes captions (or runs a frozen text tower) and appends each kept
sample's field bytes to temporary files. It returns a small :class:`ShardResult` (keys, captions,
skips, conversion counts); the parent assigns global ids and writes the training shards.

The tokenizer and towers live in the module-level :data:`STATE`, set by the parent before the pool
forks, so workers share them copy-on-write instead of loading them once each.
"""

from __future__ import annotations

import errno
import io
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from toolkit.data.images import DEFAULT_MAX_IMAGE_PIXELS, ImageError, decode_rgb
from toolkit.data.raw.reader import RawSample, RawShardReader, expected_keys, shard_basename

# Set by the parent before workers start: 'tokenizer', 'image_tower', 'text_tower', 'reference' (or None:
# reference.Reference, precompute --reference-model), and 'on_read' (or None): called with 1 after each sample read from a tar, for progress in samples.
STATE: dict[str, Any] = {}
# Frozen-tower forward passes and tokenization run over this many samples at a time.
ENCODE_BATCH = 64


@dataclass(frozen=True)
class ShardTask:
    index: int
    url: str
    stem: str  # row files are written to stem + '.image' and stem + '.text'
    image_size: int
    resize_mode: str = "center_crop"
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    caption_ext: str = "txt"
    storage: str = "pixels"  # pixels: rows of pixels; jpeg/index: rows of REF_ROW (offset, length, hash)
    jpeg_quality: int = 90


# jpeg/index scratch rows: (offset, length, xxh3-64) of the image bytes, little-endian uint64 each; for
# index the offset is into the raw tar, for jpeg into the shard's '<stem>.jpg' scratch file.
REF_ROW = np.dtype([("offset", "<u8"), ("length", "<u8"), ("hash", "<u8")])


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
    reference_s: float = 0.0  # seconds this shard's reference pass took in its worker (precompute --reference-model)
    num_captions_cut: int = 0  # kept captions longer than the context: their tokens past it are not stored


def caption_of(sample: RawSample, ext: str) -> tuple[str | None, tuple[str, str] | None]:
    """(caption, None) or (None, (reason, message)) for the sample's caption member.

    ``ext`` names the member: ``txt`` (its text), or ``json`` / ``json:FIELD``: the string ``FIELD``
    (default ``caption``, where img2dataset writes it) of the member's JSON object, never the JSON text itself.
    """
    member, _, key = ext.partition(":")
    if member == "json" and not key:
        key = "caption"
    if member not in sample.files:
        return None, ("missing_caption", f"no .{member} member{_caption_hint(sample, member)}")
    try:
        text = sample.files[member].decode("utf-8-sig")  # a byte-order mark (Windows editors) is no caption text
    except UnicodeDecodeError as err:
        return None, ("non_utf8_caption", f"caption is not UTF-8: {err}")
    if key:
        text, problem = _json_caption(text, member, key)
        if problem is not None:
            return None, problem
    text = text.strip()
    if not any(ch.isprintable() and not ch.isspace() for ch in text):  # NULs, controls: the tokenizer drops them
        return None, ("empty_caption", "caption is empty or whitespace only" if not text else
                      f"caption has no printable character ({text[:20]!r})")
    return text, None


def check_caption_ext(value: str) -> None:
    """ValueError naming the key unless ``value`` is a member extension as the reader keys them (lower case, no
    leading dot: ``txt``, ``caption.txt``) or ``json:FIELD``; '.txt' or 'TXT' matched no member at all."""
    import re

    member, colon, key = value.partition(":")
    if not re.fullmatch(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*", member) or (colon and (member != "json" or not key)):
        raise ValueError(f"caption_ext: {value!r} is not a caption member: give its extension in lower case without "
                         "the dot (txt, json, json:FIELD; members' extensions are read in lower case)")


def _json_caption(text: str, member: str, key: str) -> tuple[str, tuple[str, str] | None]:
    """The string ``key`` of the JSON object in ``text`` (a ``.member`` member), or a skip (reason, message)."""
    import json

    try:
        obj = json.loads(text)
    except ValueError as err:
        return "", ("bad_caption_json", f".{member} member is not valid JSON: {err}")
    value = obj.get(key) if isinstance(obj, dict) else None
    if value is None:
        return "", ("missing_caption", f"the .{member} member has no {key!r} key")
    if not isinstance(value, str):
        return "", ("bad_caption_json", f"{key!r} of the .{member} member is a {type(value).__name__}, not a string")
    return value, None


def _caption_hint(sample: RawSample, member: str) -> str:
    """Why a caption member is missing, when the sample shows it: its .json holds a caption (img2dataset writes
    it there too; some webdatasets carry it only there), or its files were grouped under a dotted key."""
    if member != "json" and b'"caption"' in sample.files.get("json", b""):
        return " (its .json member has a 'caption': --caption-ext json reads it)"
    return members_hint(sample)


def members_hint(sample: RawSample) -> str:
    """' (members: ...)' of a skipped sample; for files named ``name.part.ext`` it adds webdataset's rule that
    put them all under the key ``name``, which is why no member is called ``.txt`` or ``.jpg``."""
    names = sorted(sample.files)
    listed = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
    if any("." in ext for ext in names):
        return (f" (members: {listed}; a key ends at the first dot of the file name, so files named "
                f"{sample.key}.<part>.<ext> form one sample {sample.key!r}: rename them without dots in the key)")
    return f" (members: {listed})"


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


def _encode_images(rows: list[np.ndarray]) -> np.ndarray:
    return STATE["image_tower"].encode(np.stack(rows))


def _image_row(task: ShardTask, sample: RawSample, ext: str, data: bytes, pixels: np.ndarray, jpg) -> bytes:
    """The scratch row of one kept image: its pixels, or (offset, length, hash) of the bytes an index
    (raw member) or jpeg set (re-encoded at the model size) will point at."""
    import xxhash

    if task.storage == "pixels":
        return pixels.tobytes()
    if task.storage == "index":
        offset, length = sample.offsets[ext]
    else:
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=task.jpeg_quality)
        data, offset, length = buf.getvalue(), jpg.tell(), len(buf.getvalue())
        jpg.write(data)
    return np.array([(offset, length, xxhash.xxh3_64_intdigest(data))], REF_ROW).tobytes()


def check_index_offsets(url: str, image_path: str) -> None:
    """Index mode: read the first kept image back at its recorded offset in the raw tar; a compressed tar
    (offsets of the decompressed stream) fails here, naming the shard, instead of on every training read."""
    import xxhash

    from toolkit.core import files

    with open(image_path, "rb") as fh:
        offset, length, digest = (int(v) for v in np.frombuffer(fh.read(REF_ROW.itemsize), REF_ROW)[0])
    with files.open_ranges(url) as fh:
        try:
            fh.seek(offset)
            data = fh.read(length)
        except ValueError as err:  # fsspec's HTTP file: the server sent the whole file for a byte range
            raise ValueError("storage index reads each image as a byte range, and this server does not "
                             f"answer HTTP Range requests ({err}); serve the shards with one that does "
                             "(toolkit data serve, any object store), or use storage pixels or jpeg") from err
        if xxhash.xxh3_64_intdigest(data) != digest:
            raise ValueError(f"{url}: storage index needs uncompressed tars (the image bytes are not at their tar "
                             "offsets in the file); decompress the shards or use storage pixels or jpeg")


def _write_text(path: str, captions: list[str]) -> int:
    """Tokens (int32 little-endian) or frozen text features (float16) for ``captions``, in order; returns how
    many captions the tokenizer cut at the context length (0 with a text tower, whose cut is its own)."""
    num_cut = 0
    with open(path, "wb") as fh:
        for start in range(0, len(captions), ENCODE_BATCH):
            chunk = captions[start:start + ENCODE_BATCH]
            if STATE.get("text_tower") is not None:
                fh.write(np.ascontiguousarray(STATE["text_tower"].encode(chunk), dtype="<f2").tobytes())
            else:
                tokens = STATE["tokenizer"](chunk)
                num_cut += count_cut(chunk, tokens)
                fh.write(np.ascontiguousarray(tokens.numpy(), dtype="<i4").tobytes())
    return num_cut


def count_cut(chunk: list[str], tokens) -> int:
    """Captions of ``chunk`` longer than the context that gave ``tokens`` [n, L]. Only full rows (not ending in
    padding: cut, or exactly L tokens) can be; they are tokenized one position longer, and a cut one's first L
    tokens differ (its end-of-text token was put over its L-th token), whatever the tokenizer pads with. A
    tokenizer without a ``context_length`` argument: every full row counts."""
    length = tokens.shape[1]
    if "pad_token" not in STATE:  # an empty caption's last position is padding (L >= 3 for every model)
        STATE["pad_token"] = int(STATE["tokenizer"]([""])[0, -1])
    full = (tokens[:, -1] != STATE["pad_token"]).nonzero().flatten().tolist()
    if not full:
        return 0
    try:
        longer = STATE["tokenizer"]([chunk[i] for i in full], context_length=length + 1)
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
            res.skips.append((reason, f"<unknown {i + 1}>", f"_stats.json counts {count} successes, "
                                                              f"the tar holds {len(seen)} samples"))


def process_shard(task: ShardTask) -> ShardResult:
    """Process one raw shard into temp files under ``task.tmp_dir``; see the module docstring."""
    try:
        return _process(task)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):  # the scratch folder is full, not the raw shard damaged
            folder = os.path.dirname(task.stem)
            raise RuntimeError(f"the scratch folder {folder} is full ({err.strerror}) while processing "
                               f"{task.url}: free space there or choose another with tmp_dir") from err
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
        fh.writelines(json.dumps([k, c], ensure_ascii=False) + "\n" for k, c in zip(keys, captions, strict=True))
    order = sorted(range(len(keys)), key=keys.__getitem__)
    np.asarray(order, "<u4").tofile(paths["order"])
    np.asarray([key_hash(keys[r]) for r in order], "<u8").tofile(paths["khash"])


def _reference_sink(task: ShardTask):
    """The reference model's row writer for this raw shard (None without ``--reference-model``)."""
    if STATE.get("reference") is None:
        return None
    from toolkit.data.trainset.reference import ReferenceSink

    return ReferenceSink(STATE["reference"], task.stem, ENCODE_BATCH, task.max_image_pixels)


def _repeat_message(task: ShardTask, sample: RawSample, partial: set[str]) -> str:
    """Why a key read again within one tar is skipped; when its first sample lacked a member, the tar lists a
    sample's files apart (``tar cf s.tar *.jpg *.txt``), and webdataset groups only consecutive members."""
    message = f"key repeats within {shard_basename(task.url)}"
    if sample.key in partial:
        message += (f" (this time with {', '.join(sorted(sample.files))}; its earlier members lacked them): a sample's "
                    "files must follow each other in the tar, as webdataset reads them; write the tar in name order")
    return message


def _read_sample(task: ShardTask, sample: RawSample, size: int) -> tuple:
    """(caption, (ext, bytes) of the image, pixels [size, size, 3] uint8, converted mode or None, None), or a
    skip's (reason, message) last with the others None: one raw sample checked and decoded as precompute keeps it."""
    caption, problem = caption_of(sample, task.caption_ext)
    image = sample.image()
    if problem is None and image is None:
        problem = ("missing_image", f"no image member{members_hint(sample)}")
    if problem is not None:
        return None, None, None, None, problem
    try:
        pixels, converted = decode_rgb(image[1], size, task.resize_mode, task.max_image_pixels)
    except ImageError as err:
        return None, None, None, None, (err.reason, f".{image[0]}: {err}")
    return caption, image, pixels, converted, None


def _process(task: ShardTask) -> ShardResult:
    res, keys, captions = ShardResult(task.index, task.url), [], []
    res.image_path, res.text_path = task.stem + ".image", task.stem + ".text"
    on_read = STATE.get("on_read") or (lambda _n: None)
    tower = STATE.get("image_tower")
    sink = _FieldSink(res.image_path, _encode_images if tower is not None else None)
    size = tower.image_size if tower is not None else task.image_size
    reader = RawShardReader(task.url, task.caption_ext)
    seen, partial = set(), set()  # partial: keys skipped for a missing member
    jpg = open(task.stem + ".jpg", "wb") if task.storage == "jpeg" else None
    ref = _reference_sink(task)
    for sample in reader.samples():
        res.num_read += 1
        on_read(1)
        if sample.key in seen:
            res.skips.append(("duplicate_key", sample.key, _repeat_message(task, sample, partial)))
            continue
        seen.add(sample.key)
        caption, image, pixels, converted, problem = _read_sample(task, sample, size)
        if problem is not None:
            res.skips.append((problem[0], sample.key, problem[1]))
            if problem[0] in ("missing_image", "missing_caption"):
                partial.add(sample.key)
            continue
        if converted:
            res.converted[converted] += 1
        sink.add(pixels if tower is not None else _image_row(task, sample, image[0], image[1], pixels, jpg))
        if ref is not None:  # the reference decodes the raw bytes itself, through its own transform
            ref.add(image[1])
        keys.append(sample.key)
        captions.append(caption)
    sink.close()
    if jpg is not None:
        jpg.close()
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
    res.num_captions_cut = _write_text(res.text_path, captions)
    if ref is not None:
        ref.close(captions)
        res.reference_s = round(ref.seconds, 3)
    write_keys(task.stem, keys, captions)  # after the row files: resume checks the rows against its count
    res.num_kept = len(keys)
    if task.storage == "index" and keys:
        check_index_offsets(task.url, res.image_path)
    return res
