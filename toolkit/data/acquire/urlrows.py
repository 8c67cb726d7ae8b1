"""The rows of a URL list as ``fetch`` hands them to img2dataset: malformed rows and duplicate URLs are
skipped and counted with their line numbers instead of aborting the run or being downloaded twice.

img2dataset parses a list with pyarrow, where one bad row (a stray quote, a wrong number of fields,
invalid UTF-8, a line that is not JSON) aborts the whole fetch with a traceback and no line number.
:func:`read_rows` reads csv/tsv/txt/jsonl line by line, json and parquet with pandas/pyarrow, and keeps
every row it can use as (url, caption) strings; :func:`write_rows` stores them as the one parquet file
img2dataset then reads. Line numbers are the file's (header = line 1); json and parquet rows are counted
from 1 ("row N"). A UTF-8 byte order mark at the start of a text list is dropped.

Duplicates: every URL after its first occurrence is skipped as ``duplicate_url`` unless
``keep_duplicates``. Finding them holds the list's URLs in memory once (pyarrow strings, about the size of
the URL column), as img2dataset itself holds each list file.
"""

from __future__ import annotations

import array
import csv
import io
import json
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import fsspec
import numpy as np
import pyarrow as pa

# Rows per Arrow chunk while reading a text list (bounds the Python objects alive at once).
CHUNK_ROWS = 100_000
# Skipped rows listed per reason in the manifest (all are counted).
MAX_LISTED = 20
# Lines a csv-quoted TSV caption may continue over (pandas quotes a caption holding newlines); a quote left
# open longer is read as a literal quote, so a caption that merely starts with one costs at most this
# look-ahead.
MAX_TSV_CONTINUATION = 8
# csv's default field limit (128 KiB) is below some real captions' size; a row is a line, not a file.
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))


@dataclass
class ListRows:
    """Usable rows (``table``: url, caption) and what was skipped, by reason."""

    table: pa.Table
    num_rows: int = 0  # rows read, skipped ones included
    counts: Counter = field(default_factory=Counter)  # reason -> rows skipped
    listed: dict[str, list[str]] = field(default_factory=dict)  # reason -> 'file line N: why' (MAX_LISTED)

    def skip(self, reason: str, where: str, why: str) -> None:
        self.counts[reason] += 1
        shown = self.listed.setdefault(reason, [])
        if len(shown) < MAX_LISTED:
            shown.append(f"{where}: {why}")


class _Columns:
    """Growing url / caption columns, flushed to Arrow every CHUNK_ROWS rows, and where each row came from
    (file index and line number: 12 bytes a row, for the duplicate messages)."""

    def __init__(self, with_captions: bool):
        self.with_captions = with_captions
        self.urls: list[str] = []
        self.captions: list[str | None] = []
        self.file_index, self.line = array.array("i"), array.array("q")
        self.chunks: list[pa.Table] = []

    def add(self, url: str, caption: str | None, file_index: int, line: int) -> None:
        self.urls.append(url)
        self.captions.append(caption)
        self.file_index.append(file_index)
        self.line.append(line)
        if len(self.urls) >= CHUNK_ROWS:
            self._flush()

    def _flush(self) -> None:
        data = {"url": pa.array(self.urls, pa.large_string())}
        if self.with_captions:
            data["caption"] = pa.array(self.captions, pa.large_string())
        self.chunks.append(pa.table(data))
        self.urls, self.captions = [], []

    def table(self) -> pa.Table:
        if self.urls or not self.chunks:
            self._flush()
        return pa.concat_tables(self.chunks)

    def add_arrays(self, urls: pa.Array, captions: pa.Array | None, file_index: int) -> None:
        """A whole column at once (parquet, json): rows numbered from 1."""
        if self.urls:
            self._flush()
        data = {"url": urls.cast(pa.large_string())}
        if self.with_captions:
            data["caption"] = (captions if captions is not None else pa.nulls(len(urls))).cast(
                pa.large_string()
            )
        self.chunks.append(pa.table(data))
        self.file_index.extend([file_index] * len(urls))
        self.line.extend(range(1, len(urls) + 1))


Row = tuple[int, str | None, str | None, str | None]  # (line, url, caption, why malformed or None)


def _not_utf8(*texts: str | None) -> bool:
    """Text decoded with errors='surrogateescape' holds lone surrogates where the bytes were not UTF-8."""
    return any(t is not None and any("\udc80" <= ch <= "\udcff" for ch in t) for t in texts)


def _txt_rows(fh) -> Iterator[Row]:
    for line_no, line in enumerate(fh, start=1):
        text = line.strip()
        if text:
            yield (line_no, None, None, "not UTF-8") if _not_utf8(text) else (line_no, text, None, None)


def _csv_rows(fh, delimiter: str, url_col: str, caption_col: str | None) -> Iterator[Row]:
    reader = csv.reader(fh, delimiter=delimiter, strict=True)
    header = [h.strip() for h in next(reader, [])]
    url_i, caption_i = header.index(url_col), header.index(caption_col) if caption_col else None
    last = reader.line_num
    while True:
        start = last + 1
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as err:
            if reader.line_num == last:  # no progress: give up on the rest rather than loop
                yield start, None, None, f"unreadable from here on: {err}"
                return
            span = (
                f"; lines {start}-{reader.line_num} are lost with it (an unterminated quote swallows the "
                "lines after it)"
                if reader.line_num > start
                else ""
            )
            last = reader.line_num
            yield start, None, None, f"bad quoting: {err}{span}"
            continue
        end, last = reader.line_num, reader.line_num
        if not row:
            continue  # a blank line is no row
        if len(row) != len(header):
            span = (
                f"; it spans lines {start}-{end} (an unterminated quote swallows the lines after it)"
                if end > start
                else ""
            )
            yield start, None, None, f"{len(row)} field(s), the header has {len(header)}{span}"
            continue
        caption = row[caption_i] if caption_i is not None else None
        yield (
            (start, None, None, "not UTF-8")
            if _not_utf8(row[url_i], caption)
            else (start, row[url_i], caption, None)
        )


def _tsv_fields(
    text: str, num_fields: int, lines: Iterator[tuple[int, str]], pending: list
) -> list[str] | None:
    """One TSV row's fields: unquoted csv-style when it parses so (pandas and spreadsheets wrap a field
    holding a quote in quotes and double the quote; a quoted caption holding a newline continues over the
    next lines: :func:`_continued`), else the line split at its tabs with quotes kept as they are (TSV has no
    quoting: a caption like '"Casablanca" poster'); None when neither gives num_fields."""
    literal = text.split("\t")
    if '"' in text:
        try:
            quoted = next(csv.reader([text], delimiter="\t", strict=True))
        except csv.Error as err:  # a quote the line does not close: maybe it closes on a later line
            quoted = (
                _continued(text, lines, pending, num_fields) if "unexpected end of data" in str(err) else None
            )
        if quoted is not None and len(quoted) == num_fields:
            return quoted
    return literal if len(literal) == num_fields else None


def _continued(
    text: str, lines: Iterator[tuple[int, str]], pending: list, num_fields: int
) -> list[str] | None:
    """The fields of a csv-quoted row whose quoted caption spans lines (pandas' ``to_csv(sep="\t")`` writes a
    caption holding a newline so): ``text`` joined with up to MAX_TSV_CONTINUATION following lines, the first
    join that parses as ``num_fields`` fields; None (and the lines read are pushed back onto ``pending``) when
    none does, e.g. a caption that just starts with a quote."""
    taken: list[tuple[int, str]] = []
    for _ in range(MAX_TSV_CONTINUATION):
        item = pending.pop() if pending else next(lines, None)
        if item is None:
            break
        taken.append(item)
        try:
            fields = next(
                csv.reader(["\n".join([text, *(t for _, t in taken)])], delimiter="\t", strict=True)
            )
        except csv.Error:
            continue
        if len(fields) == num_fields:
            return fields
    pending.extend(reversed(taken))
    return None


def _tsv_rows(fh, url_col: str, caption_col: str | None) -> Iterator[Row]:
    """TSV line by line (one row a line, as text/tab-separated-values defines it): a caption that starts with
    a quote was a 'bad quoting' row, and an unterminated quote swallowed the lines after it. A csv-quoted
    caption that spans lines (:func:`_continued`) is still one row."""
    header = [h.strip() for h in next(csv.reader([fh.readline().rstrip("\r\n")], delimiter="\t"), [])]
    url_i, caption_i = header.index(url_col), header.index(caption_col) if caption_col else None
    lines = ((line_no, line.rstrip("\r\n")) for line_no, line in enumerate(fh, start=2))
    pending: list[
        tuple[int, str]
    ] = []  # lines read ahead for a quoted caption that did not close, newest first
    while (item := pending.pop() if pending else next(lines, None)) is not None:
        line_no, text = item
        if not text.strip():
            continue  # a blank line is no row
        row = _tsv_fields(text, len(header), lines, pending)
        if row is None:
            yield line_no, None, None, f"{text.count(chr(9)) + 1} field(s), the header has {len(header)}"
            continue
        caption = row[caption_i] if caption_i is not None else None
        yield (
            (line_no, None, None, "not UTF-8")
            if _not_utf8(row[url_i], caption)
            else (line_no, row[url_i], caption, None)
        )


def _jsonl_rows(fh, url_col: str, caption_col: str | None) -> Iterator[Row]:
    for line_no, line in enumerate(fh, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as err:
            yield line_no, None, None, f"not JSON: {err}"
            continue
        if not isinstance(obj, dict) or url_col not in obj:
            yield line_no, None, None, f"not a JSON object with a {url_col!r} key"
            continue
        url, caption = obj[url_col], obj.get(caption_col) if caption_col else None
        if not isinstance(url, str) or not (caption is None or isinstance(caption, str)):
            yield line_no, None, None, f"{url_col!r} or {caption_col!r} is not a string"
        elif _not_utf8(url, caption):
            yield line_no, None, None, "not UTF-8"
        else:
            yield line_no, url, caption, None


def _text_rows(fh, fmt: str, url_col: str, caption_col: str | None) -> Iterator[Row]:
    base = fmt.removesuffix(".gz")
    if base == "txt":
        return _txt_rows(fh)
    if base == "tsv":
        return _tsv_rows(fh, url_col, caption_col)
    if base == "csv":
        return _csv_rows(fh, ",", url_col, caption_col)
    return _jsonl_rows(fh, url_col, caption_col)


def _whole_file(
    fs, name: str, fmt: str, url_col: str, caption_col: str | None
) -> tuple[pa.Array, pa.Array | None]:
    """(urls, captions) of a parquet or json list (no lines to skip: the file parses whole or not at all)."""
    columns = [url_col] + ([caption_col] if caption_col else [])
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            with fs.open(name, "rb") as fh:
                table = pq.read_table(fh, columns=columns)
        else:
            import pandas as pd

            with fs.open(name, "rb", compression="gzip" if fmt.endswith(".gz") else None) as fh:
                table = pa.Table.from_pandas(pd.read_json(fh)[columns], preserve_index=False)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(f"{name}: unreadable {fmt} URL list: {type(err).__name__}: {err}") from err
    urls = table.column(url_col).combine_chunks()
    return urls, table.column(caption_col).combine_chunks() if caption_col else None


def read_rows(
    urls: str, fmt: str, url_col: str, caption_col: str | None, keep_duplicates: bool = False
) -> ListRows:
    """Every usable row of the list (a file or a folder of ``*.{fmt}`` files, in name order); see the module
    doc."""
    fs, path = fsspec.core.url_to_fs(urls)
    names = sorted(fs.glob(f"{path.rstrip('/')}/*.{fmt}")) if fs.isdir(path) else [path]
    cols, rows = _Columns(caption_col is not None), ListRows(pa.table({}))
    for index, name in enumerate(names):
        if fmt.removesuffix(".gz") in ("parquet", "json"):
            urls_arr, captions = _whole_file(fs, name, fmt, url_col, caption_col)
            cols.add_arrays(urls_arr, captions, index)
            rows.num_rows += len(urls_arr)
            continue
        try:
            _read_text_file(fs, name, fmt, url_col, caption_col, index, cols, rows)
        except (csv.Error, OSError, EOFError, ValueError) as err:  # the header, or a damaged gzip stream
            raise ValueError(f"{name}: unreadable {fmt} URL list: {type(err).__name__}: {err}") from err
    rows.table = cols.table()
    if not keep_duplicates:
        rows.table = _drop_duplicates(rows, cols, names)
    return rows


def _read_text_file(
    fs, name: str, fmt: str, url_col: str, caption_col: str | None, index: int, cols: _Columns, rows: ListRows
) -> None:
    with (
        fs.open(name, "rb", compression="gzip" if fmt.endswith(".gz") else None) as raw,
        io.TextIOWrapper(raw, encoding="utf-8-sig", errors="surrogateescape", newline="") as fh,
    ):
        for line, url, caption, why in _text_rows(fh, fmt, url_col, caption_col):
            rows.num_rows += 1
            if why is not None:
                rows.skip("malformed_row", f"{name} line {line}", why)
            else:
                cols.add(url, caption, index, line)


def _drop_duplicates(rows: ListRows, cols: _Columns, names: list[str]) -> pa.Table:
    """The table without every URL's later occurrences, which are counted as ``duplicate_url``."""
    table = rows.table
    if table.num_rows == 0:
        return table
    codes = table.column("url").combine_chunks().dictionary_encode().indices.fill_null(-1)
    codes = np.asarray(codes)
    values, first = np.unique(codes, return_index=True)
    keep = np.zeros(len(codes), bool)
    keep[first] = True
    keep[codes == -1] = True  # missing URLs are not duplicates of each other (they fail as bad_url)
    dups = np.flatnonzero(~keep)
    if len(dups) == 0:
        return table
    firsts = first[np.searchsorted(values, codes[dups])]
    for dup, orig in zip(dups[:MAX_LISTED], firsts[:MAX_LISTED], strict=True):
        url = table.column("url")[int(dup)].as_py()
        rows.skip(
            "duplicate_url",
            _where(names, cols, int(dup)),
            f"same URL as {_where(names, cols, int(orig))}: {url[:200]}",
        )
    rows.counts["duplicate_url"] += len(dups) - min(len(dups), MAX_LISTED)
    return table.filter(pa.array(keep))


def _unit(name: str) -> str:
    return "row" if name.endswith((".parquet", ".json", ".json.gz")) else "line"


def _where(names: list[str], cols: _Columns, row: int) -> str:
    name = names[cols.file_index[row]]
    return f"{name} {_unit(name)} {cols.line[row]}"


def write_rows(rows: ListRows, path: str) -> None:
    """Store the usable rows as the parquet file (columns url, caption) img2dataset reads."""
    import pyarrow.parquet as pq

    with fsspec.open(path, "wb") as fh:
        pq.write_table(rows.table, fh)
