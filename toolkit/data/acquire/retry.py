"""``toolkit data fetch --retry-failed``: fetch again only the URLs that failed for a transient reason.

img2dataset records every URL's outcome in its shard's ``NNNNN.parquet`` (``status``, ``error_message``).
A retry *round* collects the failures whose reason (:func:`toolkit.data.raw.reasons.classify`) is
transient — timeouts, HTTP 5xx / 408 / 429, refused, reset or cut connections — and fetches them into NEW
shards after the last one, so finished shards are never rewritten. 404s, decode errors, size limits and
the like are permanent and never retried.

The round is written before anything is downloaded: ``OUT/_retries/round-NNNNN.parquet`` (url,
caption, source shard and key, reason) and ``round-NNNNN.json`` (first shard id, samples per shard).
Row i of a round goes to shard ``first_shard + i // samples_per_shard``, so a killed round resumes like
a fetch (its finished shards are kept) and a row counts as *superseded* once its new shard is finished:
the summary then counts it once, by its new outcome, and the next round does not pick it again. A run
with no transient failure left says so and changes nothing.
"""

from __future__ import annotations

import io
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from toolkit.core import files
from toolkit.core.log import get_logger
from toolkit.data.raw import layout, reasons

log = get_logger("data.fetch")
RETRY_DIR = "_retries"
# The round's url/caption list that the fetch worker reads, under OUT/_tmp/ (beside fetch's urls.parquet).
ROWS_FILE = "retry-urls.parquet"
# Reasons worth another attempt: the server or the network failed, not the URL or the image. dns_error is
# left out: "Name or service not known" (a dead domain) and a resolver hiccup share one message pattern.
TRANSIENT = frozenset(
    {"timeout", "connection_refused", "connection_error", "incomplete_transfer", "http_408", "http_429"}
)
_HTTP_5XX = re.compile(r"^http_5\d\d$")


def is_transient(reason: str) -> bool:
    return reason in TRANSIENT or bool(_HTTP_5XX.match(reason))


@dataclass(frozen=True)
class Round:
    """One retry round: ``num_rows`` failed URLs fetched into shards from ``first_shard`` on."""

    index: int
    first_shard: int
    num_rows: int
    samples_per_shard: int

    @property
    def shard_ids(self) -> list[int]:
        return list(range(self.first_shard, self.first_shard + -(-self.num_rows // self.samples_per_shard)))

    def stem(self, out: str) -> str:
        return files.join(out, RETRY_DIR, f"round-{self.index:05d}")


def rounds(out: str) -> list[Round]:
    """Every round recorded in ``out``, oldest first."""
    import fsspec

    folder = files.join(out, RETRY_DIR)
    fs, path = fsspec.core.url_to_fs(folder)
    if not fs.exists(path):
        return []
    names = sorted(entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False))
    return [
        Round(**files.read_json(files.join(folder, n)))
        for n in names
        if re.fullmatch(r"round-\d{5}\.json", n)
    ]


def _read_round(out: str, rnd: Round):
    import pyarrow.parquet as pq

    with files.open_file(rnd.stem(out) + ".parquet", "rb") as fh:
        return pq.read_table(fh)


def superseded(out: str, finished: set[int]) -> tuple[set[tuple[int, str]], Counter[str]]:
    """(source shard, key) of every failed row whose retry shard is finished, and their old reasons."""
    rows: set[tuple[int, str]] = set()
    old: Counter[str] = Counter()
    for rnd in rounds(out):
        table = _read_round(out, rnd).to_pydict()
        for i, (shard, key, reason) in enumerate(
            zip(table["source_shard"], table["source_key"], table["reason"], strict=True)
        ):
            if rnd.first_shard + i // rnd.samples_per_shard in finished:
                rows.add((shard, key))
                old[reason] += 1
    return rows, old


def failures(out: str, shard_ids: set[int]) -> list[dict[str, Any]]:
    """Every failed URL of the finished shards ``shard_ids``: url, caption, source shard and key, reason."""
    import pyarrow.parquet as pq

    found = []
    for shard_id in sorted(shard_ids):
        with files.open_file(files.join(out, f"{layout.shard_stem(shard_id)}.parquet"), "rb") as fh:
            table = pq.read_table(fh).to_pydict()
        captions = table.get("caption") or [None] * len(table["url"])
        for url, caption, key, status, message in zip(
            table["url"], captions, table["key"], table["status"], table["error_message"], strict=True
        ):
            if status != reasons.SUCCESS:
                found.append(
                    {
                        "url": url,
                        "caption": caption,
                        "source_shard": shard_id,
                        "source_key": key,
                        "reason": reasons.classify(message or ""),
                    }
                )
    return found


def plan(
    out: str, finished: set[int], samples_per_shard: int, min_first_shard: int
) -> tuple[Round | None, Counter[str], Counter[str]]:
    """The round to fetch now: an unfinished one (resume), else a new one of the transient failures not
    yet superseded, its shards numbered from after every shard present and at least ``min_first_shard``
    (the URL list's own shard count); None when there is none. Also the open failures by reason that
    are retried / kept."""
    done_rows, _ = superseded(out, finished)
    open_failures = [
        f for f in failures(out, finished) if (f["source_shard"], f["source_key"]) not in done_rows
    ]
    retried = Counter(f["reason"] for f in open_failures if is_transient(f["reason"]))
    kept = Counter(f["reason"] for f in open_failures if not is_transient(f["reason"]))
    previous = rounds(out)
    if previous and not set(previous[-1].shard_ids) <= finished:
        return previous[-1], retried, kept
    if not retried:
        return None, retried, kept
    rows = [f for f in open_failures if is_transient(f["reason"])]
    first = max(max(layout.shard_files(out), default=-1) + 1, min_first_shard)
    rnd = Round(len(previous) + 1, first, len(rows), samples_per_shard)
    _write_round(out, rnd, rows)
    return rnd, retried, kept


def _write_round(out: str, rnd: Round, rows: list[dict[str, Any]]) -> None:
    """The round's rows, then its description (written last: a round without it was never started)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {k: [r[k] for r in rows] for k in ("url", "caption", "source_shard", "source_key", "reason")}
    files.makedirs(files.join(out, RETRY_DIR))
    buf = io.BytesIO()
    pq.write_table(pa.table(columns), buf)
    files.write_bytes_atomic(rnd.stem(out) + ".parquet", buf.getvalue())
    files.write_json_atomic(
        rnd.stem(out) + ".json",
        {
            "index": rnd.index,
            "first_shard": rnd.first_shard,
            "num_rows": rnd.num_rows,
            "samples_per_shard": rnd.samples_per_shard,
        },
    )


def write_worker_list(out: str, rnd: Round, path: str, with_captions: bool) -> None:
    """The round's url (and caption) columns where the fetch worker reads its URL list."""
    import pyarrow.parquet as pq

    table = _read_round(out, rnd).select(["url", "caption"] if with_captions else ["url"])
    # the first fetch of the same run has just removed OUT/_tmp (its worker cleans up after itself)
    files.makedirs(path.rsplit("/", 1)[0])
    with files.open_file(path, "wb") as fh:
        pq.write_table(table, fh)


def remove(out: str) -> None:
    """Forget every round (``--overwrite`` deletes the shards they point to)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(files.join(out, RETRY_DIR))
    if fs.exists(path):
        fs.rm(path, recursive=True)
