"""URL lists for ``toolkit data fetch``: format detection, column checks and a content digest.

Formats are img2dataset's: csv, tsv, parquet, jsonl, json and txt (one URL a line), each optionally
gzipped, as one file or a folder of files (local or any fsspec URL).
"""

from __future__ import annotations

import hashlib
import json

import fsspec

from toolkit.core.log import get_logger

log = get_logger("data.fetch")
FORMATS = ("txt", "csv", "tsv", "parquet", "jsonl", "json")


def detect_format(urls: str, input_format: str = "auto") -> str:
    """The img2dataset input format of ``urls`` (from the extension, or the files in a folder)."""
    if not urls.strip():
        raise ValueError("no URL list given (--urls)")
    if input_format != "auto":
        return input_format
    fs, path = fsspec.core.url_to_fs(urls)
    names = [path] if not fs.isdir(path) else fs.ls(path, detail=False)
    found = {fmt for name in names if (fmt := _format_of(name))}
    if len(found) == 1:
        return found.pop()
    what = "files in the folder" if fs.isdir(path) else "extension"
    seen = ", ".join(sorted(found)) or "none"
    raise ValueError(
        f"{urls}: cannot tell the URL list format from its {what} ({seen}); "
        f"set --input-format to one of {', '.join(FORMATS)}"
    )


def _format_of(name: str) -> str | None:
    base = name[:-3] if name.endswith(".gz") else name
    ext = base.rsplit(".", 1)[-1].lower() if "." in base.rsplit("/", 1)[-1] else ""
    return (ext + (".gz" if name.endswith(".gz") else "")) if ext in FORMATS else None


def list_columns(path: str, fmt: str) -> list[str] | None:
    """Column names of one URL list file (None where they cannot be read cheaply: json, or a jsonl whose
    first line is not a JSON object). Only the first line is decoded: a bad byte further down is a bad
    row (:mod:`.urlrows`), not a bad list. A UTF-8 byte order mark is not part of the first name."""
    compression = "gzip" if fmt.endswith(".gz") else None
    base = fmt.removesuffix(".gz")
    if base == "parquet":
        import pyarrow.parquet as pq

        with fsspec.open(path, "rb") as fh:
            try:
                return list(pq.read_schema(fh).names)
            except ValueError as err:  # pyarrow's ArrowInvalid names no file ("Parquet magic bytes ...")
                raise ValueError(
                    f"{path}: not a readable parquet file ({err}); give the list's real format "
                    "by its extension (.csv, .tsv, .jsonl, .json, .txt)"
                ) from None
    if base not in ("csv", "tsv", "jsonl"):
        return None
    with fsspec.open(path, "rb", compression=compression) as fh:
        raw = fh.readline()
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):  # spreadsheets' "Unicode text" export (UTF-16)
        raise ValueError(
            f"{path}: the file is UTF-16 text (a spreadsheet's 'Unicode text' export); URL lists are "
            "read as UTF-8: save it as 'CSV UTF-8', or convert it (iconv -f UTF-16 -t UTF-8)"
        )
    first = raw.decode("utf-8-sig", errors="replace")
    if base == "jsonl":
        try:
            obj = json.loads(first) if first.strip() else {}
        except ValueError:
            return None
        return list(obj) if isinstance(obj, dict) else None
    import csv

    try:
        header = next(csv.reader([first], delimiter="\t" if base == "tsv" else ","), [])
    except csv.Error as err:  # a stray carriage return or NUL in the header line
        raise ValueError(f"{path}: unreadable header line: {err}") from err
    return [h.strip() for h in header]


def check_url_list(urls: str, fmt: str, url_col: str, caption_col: str) -> str | None:
    """Raise a clear error for a missing list or column; return the caption column img2dataset gets."""
    fs, path = fsspec.core.url_to_fs(urls)
    if not fs.exists(path):
        raise FileNotFoundError(f"URL list not found: {urls}")
    if fmt.startswith("txt"):
        if caption_col and caption_col != "caption":
            log.warning("%s: txt URL lists have no columns; caption_col=%r ignored", urls, caption_col)
        return None
    files = [path] if not fs.isdir(path) else sorted(fs.glob(f"{path.rstrip('/')}/*.{fmt}"))
    if not files:
        raise ValueError(f"{urls}: no *.{fmt} files in the folder")
    if fs.isdir(path):
        _warn_unread(urls, fmt, fs, path, files)
    for name in files:
        columns = list_columns(fs.unstrip_protocol(name), fmt)
        if columns is None:
            continue
        for key, col in (("url_col", url_col), ("caption_col", caption_col)):
            if col and col not in columns:
                hint = "; set --caption-col '' for a list without captions" if key == "caption_col" else ""
                raise ValueError(
                    f"{name}: no column {col!r} ({key}); columns are: {', '.join(columns) or 'none'}{hint}"
                )
    return caption_col or None


def _warn_unread(urls: str, fmt: str, fs, path: str, files: list[str]) -> None:
    """Name the folder's other entries (a part-00001.csv.gz beside *.csv files, a subfolder, notes): only
    ``*.{fmt}`` files are read, and their URLs would otherwise be left out without a word."""
    read = {f.rstrip("/") for f in files}
    other = sorted(
        e.rstrip("/").rsplit("/", 1)[-1]
        for e in fs.ls(path, detail=False)
        if e.rstrip("/") not in read and not e.rstrip("/").rsplit("/", 1)[-1].startswith(".")
    )
    if other:
        shown = ", ".join(other[:10]) + (", ..." if len(other) > 10 else "")
        log.warning(
            "%s: %d entr%s in the folder %s not *.%s and not read: %s",
            urls,
            len(other),
            "y" if len(other) == 1 else "ies",
            "is" if len(other) == 1 else "are",
            fmt,
            shown,
        )


def list_digest(urls: str) -> str:
    """sha256 over the URL list's bytes (every file of a folder, in name order)."""
    fs, path = fsspec.core.url_to_fs(urls)
    files = sorted(fs.find(path)) if fs.isdir(path) else [path]
    digest = hashlib.sha256()
    for name in files:
        digest.update(name.removeprefix(path).encode() + b"\0")
        with fs.open(name, "rb") as fh:
            while chunk := fh.read(1 << 23):
                digest.update(chunk)
    return digest.hexdigest()
