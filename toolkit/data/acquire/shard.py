"""``toolkit data shard``: local images + captions into raw shards, without any download.

Two sources:
- a folder: every image (an extension of :data:`toolkit.data.images.IMAGE_EXTS`, searched recursively)
  with a sidecar caption file of the same name and ``.txt`` extension (``cat.png`` + ``cat.txt``);
- a CSV (or TSV) file with a path and a caption column; relative paths are read against the file's folder.

The output is exactly ``fetch``'s layout (see :mod:`toolkit.data.raw.layout`): images go through the same
img2dataset resizer (and the same strict Pillow check), the per-sample ``.json`` carries img2dataset's
fields, and every input that cannot become a sample is counted by reason in ``NNNNN_stats.json``,
``NNNNN.parquet`` (status and error_message per row) and the stage manifest. Deeper checks that need the
model (decoding at model resolution, tokenizing) are precompute's job.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import tarfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.pool import ThreadPool
from pathlib import Path
from typing import Any, Literal

from toolkit.core import files
from toolkit.core.config import option
from toolkit.core.log import counter, get_logger
from toolkit.core.stage import StageResult, stage_run
from toolkit.data.acquire.resizer import CheckedResizer
from toolkit.data.images import IMAGE_EXTS
from toolkit.data.raw import layout, reasons

KIND = "data.shard"
log = get_logger("data.shard")
# Columns of img2dataset's per-shard parquet, in its order (caption and url first: the input columns).
# Names of ignored input files listed in the manifest (all are counted).
MAX_LISTED = 20
PARQUET_COLUMNS = (
    "caption",
    "url",
    "key",
    "status",
    "error_message",
    "width",
    "height",
    "original_width",
    "original_height",
    "exif",
    "sha256",
)


@dataclass(frozen=True)
class ShardConfig:
    source: str = option(
        doc="A folder of images with sidecar .txt captions, or a CSV/TSV file of path,caption.", is_input=True
    )
    out: str = option(doc="Output folder (local or fsspec URL) for the raw shards and the manifest.")
    path_col: str = option(
        "path", doc="CSV column with the image path (relative to the CSV's folder or absolute)."
    )
    caption_col: str = option("caption", doc="CSV column with the caption.")
    image_size: int = option(256, ge=1, doc="Target image side in pixels (see resize_mode).")
    resize_mode: Literal["border", "center_crop", "keep_ratio", "keep_ratio_largest", "no"] = option(
        "border",
        doc="img2dataset resize mode: border (fit, pad white), center_crop, keep_ratio, "
        "keep_ratio_largest, no.",
    )
    encode_quality: int = option(95, ge=1, le=100, doc="JPEG quality of the stored images.")
    strict_decode: bool = option(
        True, doc="Fully decode every image with Pillow first (rejects truncated files)."
    )
    samples_per_shard: int = option(10000, ge=1, doc="Input rows per shard.")
    num_threads: int = option(
        4,
        ge=1,
        affects_output=False,
        doc="Threads reading and checking images (resizing "
        "runs on one thread: img2dataset's is not thread-safe).",
    )
    keep_duplicates: bool = option(
        False,
        doc="Shard an image every time the CSV lists it; by default only its "
        "first row is kept and the others fail as duplicate_url.",
    )


@dataclass
class Item:
    """One input row: an image path, its caption, or why it cannot be a sample."""

    path: str
    caption: str | None
    error: str | None = None


# ---------------------------------------------------------------- reading the source


def read_caption(path: Path) -> tuple[str | None, str | None]:
    """(caption, None) or (None, error message) for a sidecar caption file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None, f"missing caption: no {path.name} beside the image"
    except OSError as err:
        return None, f"unreadable caption: {path}: {err}"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, f"caption not utf-8: {path}: {err}"
    return _check_caption(text, str(path))


def _check_caption(text: str | None, where: str) -> tuple[str | None, str | None]:
    # Windows editors start UTF-8 files with a byte order mark (U+FEFF), which is no part of the caption
    text = (text or "").strip().lstrip("\ufeff").strip()
    if not text:
        return None, f"empty caption: {where}"
    return text, None


def items_from_folder(root: Path) -> tuple[list[Item], dict[str, int], list[str]]:
    """Images under ``root`` (sorted) with their sidecar captions; counts of other files, and the names of
    the files ignored (a ``.tar.gz`` of images, notes, ...) relative to ``root``."""
    items, other, ignored = [], Counter(), []
    paths = sorted(p for p in root.rglob("*") if p.is_file())
    images = {p.with_suffix("") for p in paths if p.suffix.lower().lstrip(".") in IMAGE_EXTS}
    for p in paths:
        if p.suffix.lower().lstrip(".") in IMAGE_EXTS:
            caption, error = read_caption(p.with_suffix(".txt"))
            items.append(Item(str(p), caption, error))
        elif p.suffix == ".txt" and p.with_suffix("") not in images:
            other["captions_without_image"] += 1
        elif p.suffix != ".txt":
            other["ignored_files"] += 1
            ignored.append(str(p.relative_to(root)))
    return items, dict(other), ignored


def items_from_csv(path: Path, path_col: str, caption_col: str, keep_duplicates: bool = False) -> list[Item]:
    """Rows of a CSV/TSV with ``path_col`` and ``caption_col``; errors name the file and column. A path
    listed again is a ``duplicate url`` failure (the first row is kept) unless ``keep_duplicates``."""
    delimiter = "\t" if path.suffix.lower() in (".tsv", ".tab") else ","
    try:
        # utf-8-sig: spreadsheets save a byte order mark, which must not become part of the first column's
        # name
        with path.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh, delimiter=delimiter)
            columns = reader.fieldnames or []
            for key, col in (("path_col", path_col), ("caption_col", caption_col)):
                if col not in columns:
                    raise ValueError(
                        f"{path}: no column {col!r} ({key}); columns are: {', '.join(columns) or 'none'}"
                    )
            rows = list(reader)
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not UTF-8 text ({err})") from err
    items, first_line = [], {}
    for line, row in enumerate(rows, start=2):
        name = (row.get(path_col) or "").strip()
        if not name:
            items.append(Item("", None, f"missing image: empty {path_col!r} on line {line}"))
            continue
        image = Path(name) if os.path.isabs(name) else path.parent / name
        caption, error = _check_caption(row.get(caption_col), f"{path} line {line}")
        seen = first_line.setdefault(os.path.normpath(image.absolute()), line)
        if seen != line and not keep_duplicates:
            error = f"duplicate url: {path} line {line} names the image of line {seen} ({name})"
        items.append(Item(str(image), caption, error))
    return items


def collect(cfg: ShardConfig) -> tuple[list[Item], dict[str, int], list[str]]:
    """(items, counts of other files, names of ignored files) of the source folder or CSV."""
    source = Path(files.local_path(cfg.source))
    if source.is_dir():
        return items_from_folder(source)
    if source.is_file():
        return items_from_csv(source, cfg.path_col, cfg.caption_col, cfg.keep_duplicates), {}, []
    raise FileNotFoundError(f"shard source not found: {cfg.source} (expected a folder or a CSV file)")


# ---------------------------------------------------------------- one sample


def make_resizer(cfg: ShardConfig) -> CheckedResizer:
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    from img2dataset.resizer import Resizer

    resizer = Resizer(
        image_size=cfg.image_size,
        resize_mode=cfg.resize_mode,
        resize_only_if_bigger=False,
        encode_quality=cfg.encode_quality,
        encode_format="jpg",
    )
    return CheckedResizer(resizer, cfg.strict_decode)


def load(item: Item, resizer: CheckedResizer) -> tuple[Item, bytes, bytes | None, str | None]:
    """Read and check one item (thread-safe): (item, original bytes, bytes for the resizer, error)."""
    if item.error is not None:
        return item, b"", None, item.error
    try:
        data = Path(item.path).read_bytes()
    except FileNotFoundError:
        return item, b"", None, f"missing image: {item.path}"
    except OSError as err:
        return item, b"", None, f"unreadable image: {item.path}: {err}"
    prepared, error = resizer.prepare(data)
    return item, data, prepared, error


def process(
    loaded: tuple[Item, bytes, bytes | None, str | None], resizer: CheckedResizer
) -> tuple[bytes | None, dict[str, Any]]:
    """(jpeg bytes or None, img2dataset metadata without the key) for one loaded item.

    Runs on the calling thread only: img2dataset's resizer is not thread-safe (see CheckedResizer.resize).
    """
    item, data, prepared, error = loaded
    meta: dict[str, Any] = {
        "caption": item.caption,
        "url": Path(item.path).absolute().as_uri() if item.path else "",
        "status": "success",
        "error_message": None,
        "width": None,
        "height": None,
        "original_width": None,
        "original_height": None,
        "exif": None,
        "sha256": None,
    }
    if error is None:
        img, width, height, orig_w, orig_h, error = resizer.resize(prepared)
    if error is not None:
        meta.update(status="failed_to_resize", error_message=error)
        return None, meta
    meta.update(
        width=width,
        height=height,
        original_width=orig_w,
        original_height=orig_h,
        sha256=hashlib.sha256(data).hexdigest(),
    )
    return img, meta


# ---------------------------------------------------------------- writing shards


def _add(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), mtime, 0o444
    tar.addfile(info, io.BytesIO(data))


def write_shard(
    out: str,
    shard_id: int,
    items: list[Item],
    cfg: ShardConfig,
    resizer,
    pool: ThreadPool,
    on_sample: Callable[[int], None] | None = None,
) -> Counter:
    """Write one shard's tar, parquet and stats; returns its status counts (message -> n).

    ``on_sample(1)`` is called after each input (kept or failed): progress in samples, not shards.
    """
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    start, status, rows = time.time(), Counter(), []
    fs, base = fsspec.core.url_to_fs(f"{out}/{layout.shard_stem(shard_id)}")
    with fs.open(base + ".tar", "wb") as fh, tarfile.open(fileobj=fh, mode="w") as tar:
        loaded = pool.imap(lambda it: load(it, resizer), items)  # reading and Pillow decoding in threads
        for index, (img, meta) in enumerate(process(one, resizer) for one in loaded):
            meta = {
                "caption": meta.pop("caption"),
                "url": meta.pop("url"),
                "key": layout.img2dataset_key(index, shard_id, cfg.samples_per_shard),
                **meta,
            }
            rows.append(meta)
            if on_sample is not None:
                on_sample(1)
            if img is None:
                status[meta["error_message"]] += 1
                continue
            status[reasons.SUCCESS] += 1
            members = {
                "jpg": img,
                "txt": meta["caption"].encode(),
                "json": json.dumps(meta, indent=4).encode(),
            }
            for ext, data in members.items():
                _add(tar, f"{meta['key']}.{ext}", data, start)
    table = pa.Table.from_pylist(
        rows,
        schema=pa.schema(
            [
                (
                    c,
                    pa.int32()
                    if c in ("width", "height", "original_width", "original_height")
                    else pa.string(),
                )
                for c in PARQUET_COLUMNS
            ]
        ),
    )
    with fs.open(base + ".parquet", "wb") as fh:
        pq.write_table(table, fh)
    layout.write_stats(out, shard_id, status, start, time.time())  # last: marks the shard finished
    return status


def run(cfg: ShardConfig) -> StageResult:
    """Shard ``cfg.source`` into ``cfg.out`` (replacing shards already there); counts in the manifest.

    Raises FileNotFoundError for a missing source, ValueError for a CSV without the columns, and
    RuntimeError when no input row makes a valid sample.
    """
    items, other, ignored = collect(cfg)
    out = layout.absolute(cfg.out)
    layout.check_owned(out, (KIND,))
    with stage_run(KIND, cfg, cfg.out) as rec:
        rec.outputs["shards"] = cfg.out
        if ignored:
            log.warning(
                "shard: %d file(s) in %s are neither images (%s) nor captions and are ignored: %s%s",
                len(ignored),
                cfg.source,
                ", ".join(IMAGE_EXTS),
                ", ".join(ignored[:5]),
                ", ..." if len(ignored) > 5 else "",
            )
            rec.details["ignored_files"] = ignored[:MAX_LISTED]
        removed = layout.remove_shards(out)
        if removed:
            log.info("shard: replaced %d shard files in %s", removed, out)
        resizer, status, start = make_resizer(cfg), Counter(), time.monotonic()
        chunks = [items[i : i + cfg.samples_per_shard] for i in range(0, len(items), cfg.samples_per_shard)]
        # progress in samples, not shards: one big shard would sit at 0/1 until the end
        with ThreadPool(cfg.num_threads) as pool, counter(len(items), desc="shard", unit="samples") as done:
            for shard_id, chunk in enumerate(chunks):
                status += write_shard(out, shard_id, chunk, cfg, resizer, pool, done.advance)
        wall_s = time.monotonic() - start
        summary = reasons.summarize_status(status)
        messages = summary.pop("messages")
        rec.counts.update(num_inputs=len(items), num_shards=len(chunks), **summary)
        rec.details.update(
            other_files=other,
            wall_s=round(wall_s, 3),
            samples_per_s=round(len(items) / wall_s, 2) if wall_s > 0 else None,
            error_messages=messages,
        )
        failures = ", ".join(f"{k} {v}" for k, v in summary["failed_by_reason"].items()) or "none"
        log.info(
            "shard: %d inputs, %d ok, %d failed (%s); %d shards in %.1f s",
            len(items),
            summary["num_success"],
            summary["num_failed"],
            failures,
            len(chunks),
            wall_s,
        )
        if summary["num_success"] == 0:
            raise RuntimeError(f"no valid sample in {cfg.source} ({len(items)} inputs; failed: {failures})")
    return rec.result()
