"""The raw shard layout shared by ``fetch`` and ``shard`` (img2dataset's webdataset output).

A raw shard folder holds, per shard ``NNNNN`` (5 digits, img2dataset's ``oom_shard_count``):
- ``NNNNN.tar``: ``<key>.jpg``, ``<key>.txt`` (caption) and ``<key>.json`` (metadata) per good sample;
- ``NNNNN.parquet``: one metadata row per input row, failures included (``status``, ``error_message``);
- ``NNNNN_stats.json``: ``count``, ``successes``, ``failed_to_download``, ``failed_to_resize``,
  ``duration``, ``start_time``, ``end_time`` and ``status_dict`` (message -> count).
A shard is finished when all three exist; img2dataset writes the stats file last.

This module also turns img2dataset's free-text error messages into a small set of reasons, so
summaries read ``http_404: 2, timeout: 1`` instead of one line per memory address.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from collections import Counter
from typing import Any

import fsspec

from toolkit.core import files

SHARD_DIGITS = 5  # img2dataset's oom_shard_count: shard names 00000..99999
_SHARD_FILE = re.compile(r"^(\d+)(\.tar|\.parquet|_stats\.json)$")
_HEX_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# Raw messages kept verbatim in the manifest details (most frequent first).
MAX_RAW_MESSAGES = 20

SUCCESS = "success"


def shard_name(shard_id: int) -> str:
    return f"{shard_id:0{SHARD_DIGITS}d}"


def sample_key(index: int, shard_id: int, samples_per_shard: int) -> str:
    """img2dataset's key for sample ``index`` of shard ``shard_id`` (e.g. '000010002')."""
    digits = math.ceil(math.log10(samples_per_shard))
    return f"{(10 ** digits) * shard_id + index:0{digits + SHARD_DIGITS}d}"


# ---------------------------------------------------------------- reasons

# (pattern, reason) tried in order against img2dataset's error messages and ours; our own messages
# (anchored at the start) go first so that bytes quoted in them cannot match a later pattern.
_REASONS: list[tuple[re.Pattern, str]] = [(re.compile(p, re.IGNORECASE), r) for p, r in [
    (r"^success$", SUCCESS),
    (r"^empty response", "empty_response"),
    (r"^not an image", "not_an_image"),
    (r"^truncated image", "truncated_image"),
    (r"^decompression bomb", "decompression_bomb"),
    (r"^corrupt image", "corrupt_image"),
    (r"^missing image", "missing_image"),
    (r"^unreadable image", "unreadable_image"),
    (r"^missing caption", "missing_caption"),
    (r"^unreadable caption", "unreadable_caption"),
    (r"^caption not utf-8", "caption_not_utf8"),
    (r"^empty caption", "empty_caption"),
    (r"HTTP Error (\d{3})", "http_{0}"),
    (r"timed out|timeout", "timeout"),
    (r"connection refused", "connection_refused"),
    (r"name or service not known|name resolution|nodename nor servname|getaddrinfo", "dns_error"),
    (r"remote end closed|connection reset|connection aborted|broken pipe", "connection_error"),
    (r"incompleteread", "incomplete_transfer"),
    (r"ssl|certificate", "ssl_error"),
    (r"no such file or directory", "file_not_found"),
    (r"unknown url type|no host given|invalid url|url can't contain", "bad_url"),
    (r"x-robots-tag", "disallowed_by_robots_tag"),
    (r"hash mismatch", "hash_mismatch"),
    (r"image decoding error", "decode_error"),
    (r"image too small", "image_too_small"),
    (r"image area too large", "image_area_too_large"),
    (r"aspect ratio too large", "aspect_ratio_too_large"),
]]


def classify(message: str) -> str:
    """A short reason for one status message: 'success', 'http_404', 'timeout', ... or 'other'."""
    for pattern, reason in _REASONS:
        match = pattern.search(message)
        if match:
            return reason.format(*match.groups())
    return "other"


def scrub(message: str) -> str:
    """Drop object addresses so equal errors aggregate ('<_io.BytesIO object at 0x7f..>')."""
    return _HEX_ADDRESS.sub("", message)[:300]


# ---------------------------------------------------------------- strict decoding


def decode_image(data: bytes):
    """Fully decode ``data`` with Pillow: (image, None) or (None, an error message :func:`classify` maps).

    OpenCV (img2dataset's decoder) silently pads some truncated files; a full Pillow decode catches
    them, and Pillow's pixel-count limit rejects decompression bombs before OpenCV allocates them.
    """
    from PIL import Image, UnidentifiedImageError

    if not data:
        return None, "empty response: 0 bytes"
    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except UnidentifiedImageError:
        return None, f"not an image: Pillow cannot identify the format (first bytes {data[:16]!r})"
    except Image.DecompressionBombError as err:
        return None, f"decompression bomb: {err}"
    except (OSError, SyntaxError, ValueError, EOFError) as err:
        if "truncated" in str(err).lower():
            return None, f"truncated image: {err}"
        return None, f"corrupt image: {type(err).__name__}: {err}"
    return img, None


def is_deep(img, data: bytes) -> bool:
    """True for images with more than 8 bits per sample, which OpenCV keeps at 16 bits."""
    from toolkit.data.images import DEEP_MODES

    if img.mode in DEEP_MODES:
        return True
    if img.format == "PNG":
        return data[24] == 16  # IHDR bit depth
    if img.format == "TIFF":
        bits = img.tag_v2.get(258, 8)  # BitsPerSample
        return max(bits if isinstance(bits, tuple) else (bits,)) > 8
    return False


def to_8bit_png(img) -> bytes:
    """Lossless 8-bit PNG of a deep image: grey gets precompute's levels (:func:`images.deep_to_l`);
    Pillow already gives RGB(A) 8 bits."""
    from toolkit.data.images import DEEP_MODES, deep_to_l

    if img.mode in DEEP_MODES:
        img = deep_to_l(img)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _deep_as_png(data: bytes) -> bytes | None:
    """Without the strict check: an 8-bit PNG of ``data`` if its header says deep, else None (also when
    Pillow cannot read it: img2dataset's own decoder then decides, as strict_decode=false asks)."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))  # reads the header only
        return to_8bit_png(img) if is_deep(img, data) else None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, Image.DecompressionBombError):
        return None


class CheckedResizer:
    """img2dataset's ``Resizer`` with Pillow in front: a full decode when ``strict``, a header read when not.

    When ``strict``, rejected images return :func:`decode_image`'s message. Either way, images with 16
    bits per sample are handed on as 8-bit PNGs: img2dataset's OpenCV path would cast 16-bit values to
    8 bits by saturation, turning nearly every pixel white. Same call signature and return tuple as
    ``img2dataset.resizer.Resizer.__call__``: (image bytes, width, height, original width, original
    height, error message). Picklable, so img2dataset's spawned download processes can use it.
    """

    def __init__(self, resizer: Any, strict: bool = True):
        self.resizer = resizer
        self.strict = strict

    def prepare(self, data: bytes) -> tuple[bytes | None, str | None]:
        """(bytes for img2dataset's resizer, None) or (None, error message); thread-safe."""
        if self.strict:
            img, error = decode_image(data)
            if error is not None:
                return None, error
            return (to_8bit_png(img) if is_deep(img, data) else data), None
        return _deep_as_png(data) or data, None

    def resize(self, data: bytes, blurring_bbox_list=None):
        """img2dataset's resizer on prepared bytes. NOT thread-safe: it dup2's fds 1 and 2 to /dev/null
        around each call, so concurrent calls can leave the process's stdout and stderr silenced."""
        return self.resizer(io.BytesIO(data), blurring_bbox_list)

    def __call__(self, img_stream, blurring_bbox_list=None):
        img_stream.seek(0)
        data, error = self.prepare(img_stream.read())
        img_stream.seek(0)  # the caller's stream (hashed and read for EXIF later) stays as it was
        if error is not None:
            return None, None, None, None, None, error
        return self.resize(data, blurring_bbox_list)


# ---------------------------------------------------------------- finished shards and summaries


def absolute(path: str) -> str:
    """img2dataset resolves local paths against the cwd: an absolute local path, or the URL without a
    trailing '/' (shard names are appended with '/')."""
    return os.path.abspath(files.local_path(path)) if files.is_local(path) else path.rstrip("/")


def _fs(out: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = fsspec.core.url_to_fs(out)
    return fs, path.rstrip("/")


def shard_files(out: str) -> dict[int, set[str]]:
    """Shard id -> which of '.tar', '.parquet', '_stats.json' exist in ``out``."""
    fs, path = _fs(out)
    found: dict[int, set[str]] = {}
    if not fs.exists(path):
        return found
    for entry in fs.ls(path, detail=False):
        match = _SHARD_FILE.match(entry.rstrip("/").rsplit("/", 1)[-1])
        if match:
            found.setdefault(int(match.group(1)), set()).add(match.group(2))
    return found


def finished_shards(out: str) -> set[int]:
    """Ids of shards whose tar, parquet and stats file all exist (the stats file is written last)."""
    return {i for i, kinds in shard_files(out).items() if {".tar", ".parquet", "_stats.json"} <= kinds}


def remove_shards(out: str) -> int:
    """Delete every shard file and img2dataset's ``_tmp/`` in ``out`` (nothing else); returns files removed."""
    fs, path = _fs(out)
    removed = 0
    for shard_id, kinds in shard_files(out).items():
        for suffix in kinds:
            fs.rm(f"{path}/{shard_name(shard_id)}{suffix}")
            removed += 1
    remove_tmp(out)
    return removed


def remove_tmp(out: str) -> bool:
    """Delete img2dataset's ``_tmp/`` (feather splits of the URL list) in ``out``; True if it existed."""
    fs, path = _fs(out)
    if not fs.exists(f"{path}/_tmp"):
        return False
    fs.rm(f"{path}/_tmp", recursive=True)
    return True


def read_stats(out: str, shard_ids: set[int] | None = None) -> dict[int, dict]:
    """Shard id -> parsed ``NNNNN_stats.json`` for finished shards (or just ``shard_ids``)."""
    fs, path = _fs(out)
    ids = sorted(finished_shards(out) if shard_ids is None else shard_ids)
    stats = {}
    for shard_id in ids:
        name = f"{path}/{shard_name(shard_id)}_stats.json"
        with fs.open(name, "r") as fh:
            try:
                stats[shard_id] = json.load(fh)
            except ValueError as err:
                raise ValueError(f"{name}: unreadable stats file ({err}); delete it to refetch the shard") from err
    return stats


def summarize_status(status: dict[str, int], num_unrecorded: int = 0) -> dict[str, Any]:
    """Status messages (message -> count, img2dataset's ``status_dict``) -> successes, failures by
    reason (most frequent first) and the most frequent raw messages, addresses scrubbed."""
    reasons: Counter[str] = Counter()
    messages: Counter[str] = Counter()
    for message, n in status.items():
        reasons[classify(message)] += n
        if message != SUCCESS:
            messages[scrub(message)] += n
    if num_unrecorded:
        reasons["unrecorded"] += num_unrecorded
    num_success = reasons.pop(SUCCESS, 0)
    return {
        "num_success": num_success,
        "num_failed": sum(reasons.values()),
        "failed_by_reason": dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
        "messages": dict(messages.most_common(MAX_RAW_MESSAGES)),
    }


def summarize(stats: dict[int, dict]) -> dict[str, Any]:
    """Totals over shards: samples, successes, failures by reason, raw messages, download seconds.

    Samples that img2dataset counted but gave no status (a writer exception it only printed) are
    reported as reason 'unrecorded', so the reasons always add up to ``num_samples``.
    """
    status: Counter[str] = Counter()
    num_samples = num_unrecorded = 0
    start, end = math.inf, -math.inf
    for shard in stats.values():
        count, recorded = int(shard.get("count", 0)), shard.get("status_dict") or {}
        num_samples += count
        start, end = min(start, shard.get("start_time", math.inf)), max(end, shard.get("end_time", -math.inf))
        status.update(recorded)
        num_unrecorded += max(0, count - sum(recorded.values()))
    summary = summarize_status(status, num_unrecorded)
    return {
        "num_samples": num_samples,
        **summary,
        "num_failed": num_samples - summary["num_success"],
        "span_s": round(end - start, 3) if stats else 0.0,
    }


def write_stats(out: str, shard_id: int, status: Counter[str], start_time: float, end_time: float,
                num_download_failed: int = 0) -> None:
    """Write ``NNNNN_stats.json`` in img2dataset's format (used by ``shard``, which downloads nothing)."""
    fs, path = _fs(out)
    count = sum(status.values())
    stats = {
        "count": count, "successes": status.get(SUCCESS, 0), "failed_to_download": num_download_failed,
        "failed_to_resize": count - status.get(SUCCESS, 0) - num_download_failed,
        "duration": end_time - start_time, "start_time": start_time, "end_time": end_time,
        "status_dict": dict(status),
    }
    with fs.open(f"{path}/{shard_name(shard_id)}_stats.json", "w") as fh:
        json.dump(stats, fh, indent=4)
