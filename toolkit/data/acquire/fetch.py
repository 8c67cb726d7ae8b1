"""``toolkit data fetch``: download a URL list into raw webdataset shards with img2dataset.

img2dataset does the downloading, resizing and writing (:mod:`.fetch_worker` runs it in a subprocess);
this module validates the URL list, decides which shards are already finished (rerunning resumes:
finished shards are never downloaded again), watches progress, and writes the summary of successes and
failures by reason plus the throughput into the stage manifest (``counts`` and ``details``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Literal

from toolkit.core import files
from toolkit.core.config import config_hash, option, to_dict
from toolkit.core.log import get_logger
from toolkit.core.stage import StageResult, fingerprint, read_manifest, stage_run
from toolkit.data.acquire import retry, urllist
from toolkit.data.acquire.fetch_process import download
from toolkit.data.acquire.urllist import check_url_list, detect_format
from toolkit.data.acquire.urlrows import ListRows, read_rows, write_rows
from toolkit.data.raw import layout, reasons

KIND = "data.fetch"
log = get_logger("data.fetch")

InputFormat = Literal[
    "auto",
    "txt",
    "csv",
    "tsv",
    "parquet",
    "jsonl",
    "json",
    "txt.gz",
    "csv.gz",
    "tsv.gz",
    "jsonl.gz",
    "json.gz",
]
ResizeMode = Literal["border", "center_crop", "keep_ratio", "keep_ratio_largest", "no"]
Distributor = Literal["multiprocessing", "pyspark", "ray"]
ExtraScheme = Literal["http", "https", "file", "ftp", "data"]
# 50 MiB: web images are rarely above 5 MB and camera JPEGs rarely above 25 MB, while one 1.5 GB URL
# otherwise costs 1.5 GB of memory. Downloads in flight hold up to this much each: img2dataset keeps up to
# 2 x threads samples per process, so the worst case is about 2 x processes x threads x max_bytes; lower
# --max-bytes or --threads on a small machine.
DEFAULT_MAX_BYTES = 50 * 2**20
# Name of the cleaned URL list (url, caption) that the worker hands img2dataset, under OUT/_tmp/.
ROWS_FILE = "urls.parquet"


@dataclass(frozen=True)
class FetchConfig:
    urls: str = option(
        doc="URL list (csv, tsv, parquet, jsonl, json or txt, optionally .gz; local or fsspec URL), "
        "or a folder of such files.",
        is_input=True,
    )
    out: str = option(doc="Output folder (local or fsspec URL) for the raw shards and the manifest.")
    input_format: InputFormat = option(
        "auto", doc="Format of the URL list; 'auto' reads it from the extension."
    )
    url_col: str = option("url", doc="Column holding the image URL (not used for txt lists: one URL a line).")
    caption_col: str = option("caption", doc="Column holding the caption; '' for none (txt lists have none).")
    image_size: int = option(256, ge=1, doc="Target image side in pixels (see resize_mode).")
    resize_mode: ResizeMode = option(
        "border",
        doc="img2dataset resize mode: border (fit, pad white), center_crop, "
        "keep_ratio (shorter side), keep_ratio_largest, no.",
    )
    resize_only_if_bigger: bool = option(False, doc="Only shrink images; never upscale smaller ones.")
    encode_quality: int = option(95, ge=1, le=100, doc="JPEG quality of the stored images.")
    min_image_size: int = option(
        0, ge=0, doc="Skip images whose shorter side is below this (reason image_too_small)."
    )
    max_image_area: float | None = option(
        None, gt=0, doc="Skip images with more pixels than this (default: no limit)."
    )
    max_aspect_ratio: float | None = option(
        None, ge=1, doc="Skip images whose long/short side ratio exceeds this."
    )
    strict_decode: bool = option(
        True,
        doc="Fully decode every image with Pillow first, rejecting truncated files "
        "and decompression bombs that OpenCV would accept or pad.",
    )
    samples_per_shard: int = option(10000, ge=1, doc="URLs per shard; a shard is the unit of resume.")
    num_processes: int = option(
        1, ge=1, affects_output=False, doc="Download processes (distributor workers)."
    )
    num_threads: int = option(32, ge=1, affects_output=False, doc="Download threads per process.")
    timeout_s: float = option(
        10.0,
        gt=0,
        affects_output=False,
        doc="Per-request socket timeout: a dead or stalled host fails the URL as 'timeout'.",
    )
    download_timeout_s: float = option(
        0.0,
        ge=0,
        affects_output=False,
        doc="Total seconds one download attempt may take, connection to last byte: "
        "a server that trickles bytes fails the URL as 'timeout'; 0: 10 x "
        "timeout_s.",
    )
    retries: int = option(0, ge=0, affects_output=False, doc="Extra attempts per failed URL.")
    max_shard_retry: int = option(1, ge=0, affects_output=False, doc="Extra attempts per shard that crashed.")
    distributor: Distributor = option(
        "multiprocessing",
        affects_output=False,
        doc="img2dataset distributor: multiprocessing, or pyspark / ray for clusters.",
    )
    subjob_size: int = option(1000, ge=1, affects_output=False, doc="Shards per pyspark job.")
    run_timeout_s: float | None = option(
        None,
        gt=0,
        affects_output=False,
        doc="Stop the whole run after this many seconds; finished shards stay and a "
        "rerun resumes (default: no limit).",
    )
    overwrite: bool = option(
        False, affects_output=False, doc="Delete the shards already in `out` first instead of resuming."
    )
    max_bytes: int = option(
        DEFAULT_MAX_BYTES,
        ge=1,
        doc="Abort a download once it exceeds this many bytes (announced or received); counted as too_large.",
    )
    allow_schemes: list[ExtraScheme] = option(
        factory=list,
        doc="URL schemes to download besides http and https, e.g. [file] for local test lists; "
        "URL lists come from the internet, so file, ftp and data URLs are refused unless "
        "named here (reason disallowed_scheme).",
    )
    keep_duplicates: bool = option(
        False,
        doc="Download every occurrence of a URL; by default only the first is "
        "kept and the others are counted as duplicate_url.",
    )
    retry_failed: bool = option(
        False,
        affects_output=False,
        doc="After fetching (or resuming), fetch again the URLs that failed for a transient "
        "reason (timeouts, HTTP 5xx/408/429, refused or broken connections; not 404s "
        "or bad images) into new shards of `out`; rerun to retry what fails again.",
    )


# ---------------------------------------------------------------- resume bookkeeping


def _changed_fields(previous: dict, cfg: FetchConfig) -> list[str]:
    import dataclasses

    now = to_dict(cfg)
    return [
        f.name
        for f in dataclasses.fields(cfg)
        if f.metadata.get("affects_output", True) and previous.get("config", {}).get(f.name) != now[f.name]
    ]


def check_resumable(cfg: FetchConfig, out: str, fmt: str, caption_col: str | None) -> str:
    """Refuse to mix shards of another config or URL list into ``out`` (unless ``overwrite``); shards without
    a manifest are resumed only if they hold this list's rows (:func:`check_foreign_shards`).

    Returns the URL list's sha256 (reused from the last manifest when the file is untouched): a shard is
    identified by its rows' position in the list, so finished shards are only valid for the same bytes.
    """
    previous = read_manifest(out) or {}
    same_file = ((previous.get("inputs") or {}).get("urls") or {}).get("fingerprint") == fingerprint(cfg.urls)
    recorded = (previous.get("details") or {}).get("urls_sha256")
    digest = recorded if same_file and recorded else urllist.list_digest(cfg.urls)
    if cfg.overwrite:
        layout.check_owned(out, (KIND, "data.shard"))  # --overwrite deletes only shards cliptk wrote
        return digest
    if not layout.shard_files(out):
        return digest
    if not previous:  # before the stage's manifest exists: once written, a rerun would trust these shards
        check_foreign_shards(cfg, fmt, caption_col, out)
        log.warning(
            "%s holds shards but no manifest; they hold the rows of %s, so they are resumed", out, cfg.urls
        )
        return digest
    if previous.get("kind") != KIND:
        raise ValueError(
            f"{out} holds the output of a {previous.get('kind')!r} stage; choose another --out "
            "or pass --overwrite to delete its shards"
        )
    if previous.get("config_hash") != config_hash(cfg, KIND):
        changed = ", ".join(_changed_fields(previous, cfg)) or "config"
        raise ValueError(
            f"{out} holds shards fetched with different settings ({changed} changed); pass "
            "--overwrite to delete them and fetch again, or choose another --out"
        )
    if recorded and recorded != digest:
        raise ValueError(
            f"{cfg.urls} changed since {out} was fetched from it (its rows decide which shard "
            "holds which URL); pass --overwrite to fetch again, or choose another --out"
        )
    return digest


def check_foreign_shards(cfg: FetchConfig, fmt: str, caption_col: str | None, out: str) -> None:
    """Shards in ``out`` that no cliptk stage wrote are resumed only if each finished one holds exactly the
    rows this list and ``samples_per_shard`` put there; otherwise ValueError naming the shard (their URLs
    were counted as fetched and the list's other URLs in those shards silently never requested)."""
    from toolkit.data.raw.verify import check_shard_urls

    urls = (
        read_rows(cfg.urls, fmt, cfg.url_col, caption_col, cfg.keep_duplicates)
        .table.column("url")
        .to_pylist()
    )
    size = cfg.samples_per_shard
    for shard_id in sorted(layout.finished_shards(out)):
        why = check_shard_urls(out, shard_id, urls[shard_id * size : (shard_id + 1) * size])
        if why is not None:
            raise ValueError(
                f"{out}/{layout.shard_stem(shard_id)}.parquet: {why}: {out} holds shards (no manifest) "
                f"that did not come from {cfg.urls} with samples_per_shard {size}; choose another "
                "--out, or move those shards away"
            )


def verified_shards(rec, out: str) -> set[int]:
    """Finished shards whose tar, parquet and stats agree; the others are deleted to be fetched again.

    Each redone shard and why is logged and recorded (``details.shards_redone``,
    ``counts.num_shards_redone``): a shard left half-written by an interrupted run, or damaged by a second run
    or a full disk.
    """
    from toolkit.data.raw.verify import check_shard

    present = layout.shard_files(out)
    redo = {
        i: f"unfinished: only {', '.join(sorted(kinds))} written"
        for i, kinds in present.items()
        if not {".tar", ".parquet", "_stats.json"} <= kinds
    }
    for shard_id in sorted(set(present) - set(redo)):
        why = check_shard(out, shard_id, deep=files.is_local(out))
        if why is not None:
            redo[shard_id] = why
    for shard_id, why in sorted(redo.items()):
        log.warning("fetch: shard %s is fetched again: %s", layout.shard_stem(shard_id), why)
        layout.remove_shard(out, shard_id)
    rec.details["shards_redone"] = {layout.shard_stem(i): why for i, why in sorted(redo.items())}
    rec.counts["num_shards_redone"] = len(redo)
    return set(present) - set(redo)


def worker_spec(
    cfg: FetchConfig,
    with_captions: bool,
    out: str,
    done: set[int],
    rows_file: str = ROWS_FILE,
    first_shard: int = 0,
) -> dict[str, Any]:
    """The JSON document ``fetch_worker`` reads; the list is the cleaned ``OUT/_tmp/urls.parquet`` (or a
    retry round's ``OUT/_tmp/retry-urls.parquet``, its shards numbered from ``first_shard``)."""
    spec = {k: v for k, v in to_dict(cfg).items() if k not in ("urls", "out", "input_format", "caption_col")}
    return {
        **spec,
        "url_list": f"{out}/_tmp/{rows_file}",
        "input_format": "parquet",
        "url_col": "url",
        "caption_col": "caption" if with_captions else None,
        "output_folder": out,
        "tmp_path": f"{out}/_tmp",
        "done_shards": sorted(done),
        "start_shard_id": first_shard,
    }


def prepare_rows(cfg: FetchConfig, fmt: str, caption_col: str | None, out: str) -> ListRows:
    """Read the URL list row by row, log the rows skipped (with line numbers) and write the usable rows
    where the worker reads them. Raises ValueError naming the file for a list that cannot be read at all."""
    rows = read_rows(cfg.urls, fmt, cfg.url_col, caption_col, cfg.keep_duplicates)
    for reason, n in sorted(rows.counts.items()):
        shown = "; ".join(rows.listed[reason][:3]) + ("; ..." if n > 3 else "")
        kept = (
            " (the first occurrence of each is fetched; keep_duplicates fetches them all)"
            if reason == "duplicate_url"
            else ""
        )
        log.warning("fetch: %d row(s) skipped as %s%s: %s", n, reason, kept, shown)
    write_rows(rows, f"{out}/_tmp/{ROWS_FILE}")
    return rows


def urls_to_download(num_rows: int, samples_per_shard: int, done: set[int]) -> int:
    """Rows of the shards not yet finished (every shard is full but the last)."""
    return sum(
        min(samples_per_shard, num_rows - i * samples_per_shard)
        for i in range(math.ceil(num_rows / samples_per_shard))
        if i not in done
    )


# ---------------------------------------------------------------- the stage


def run(cfg: FetchConfig) -> StageResult:
    """Fetch ``cfg.urls`` into ``cfg.out``; resume finished shards; summary in the manifest.

    Raises FileNotFoundError/ValueError for a bad URL list (naming file and column), RuntimeError when no
    image was downloaded at all or shards are left unfinished (rerun to resume them).
    """
    _check_distributor(cfg.distributor)
    if files.is_local(cfg.urls):  # a FIFO without a writer would block the first read forever, silently
        files.check_regular(files.local_path(cfg.urls))
    fmt = detect_format(cfg.urls, cfg.input_format)
    caption_col = check_url_list(cfg.urls, fmt, cfg.url_col, cfg.caption_col)
    out = layout.absolute(cfg.out)
    digest = check_resumable(cfg, out, fmt, caption_col)
    with stage_run(KIND, cfg, cfg.out) as rec:
        rec.outputs["shards"] = cfg.out
        rec.details["urls_sha256"] = digest
        rec.write()  # recorded before downloading, so even a killed run's shards can be checked on resume
        if cfg.overwrite:
            log.info("fetch: --overwrite: removed %d shard files from %s", layout.remove_shards(out), out)
            retry.remove(out)
        done_before = verified_shards(rec, out)
        if layout.remove_tmp(out):  # a failed run leaves img2dataset's _tmp/ behind: start clean
            log.info("fetch: removed %s/_tmp left by an interrupted run", out)
        start = time.monotonic()
        rows = prepare_rows(cfg, fmt, caption_col, out)
        num_todo = urls_to_download(rows.table.num_rows, cfg.samples_per_shard, done_before)
        outcome = {"num_shards_planned": 0, "timed_out": False}
        if num_todo or not cfg.retry_failed:  # --retry-failed on a finished fetch starts no idle worker
            spec = worker_spec(cfg, caption_col is not None, out, done_before)
            outcome = download(spec, cfg.run_timeout_s, rec.lock_fd, num_todo)
        if cfg.retry_failed:
            outcome = _retry(cfg, rec, out, caption_col is not None, rows.table.num_rows, outcome)
            layout.remove_tmp(out)  # the URL rows file, when no worker ran to clean up after itself
        wall_s = time.monotonic() - start
        summary = _record(rec, out, done_before, outcome, wall_s, rows)
        _report(summary)
        _raise_if_incomplete(cfg, summary, outcome)
    return rec.result()


def _check_distributor(name: str) -> None:
    """pyspark and ray are optional cluster dependencies: say so before starting anything."""
    import importlib.util

    if name != "multiprocessing" and importlib.util.find_spec(name) is None:
        raise ValueError(
            f"distributor {name!r} needs the {name} package (pip install {name}); "
            "or use --distributor multiprocessing"
        )


def _record(
    rec, out: str, done_before: set[int], outcome: dict, wall_s: float, rows: ListRows
) -> dict[str, Any]:
    rec.counts.update(num_rows=rows.num_rows, skipped_rows=dict(sorted(rows.counts.items())))
    rec.details["skipped_row_lines"] = rows.listed
    stats = layout.read_stats(out)
    total = _effective(out, stats)
    new = reasons.summarize({i: s for i, s in stats.items() if i not in done_before})
    num_unfinished = max(0, outcome["num_shards_planned"] - len(set(stats) - done_before))
    rec.counts.update(
        {
            "num_urls": total["num_samples"],
            "num_success": total["num_success"],
            "num_failed": total["num_failed"],
            "failed_by_reason": total["failed_by_reason"],
            "num_shards": len(stats),
            "num_shards_resumed": len(done_before & set(stats)),
            "num_shards_unfinished": num_unfinished,
        }
    )
    rec.details.update(
        {
            "this_run": {
                "num_urls": new["num_samples"],
                "num_success": new["num_success"],
                "failed_by_reason": new["failed_by_reason"],
                "wall_s": round(wall_s, 3),
                "urls_per_s": round(new["num_samples"] / wall_s, 2) if wall_s > 0 else None,
                "success_per_s": round(new["num_success"] / wall_s, 2) if wall_s > 0 else None,
                # first shard start to last shard end: the rate without process start-up and imports
                "download_s": new["span_s"],
                "download_urls_per_s": round(new["num_samples"] / new["span_s"], 2)
                if new["span_s"]
                else None,
            },
            "error_messages": total["messages"],
            "timed_out": outcome["timed_out"],
        }
    )
    rec.counts["num_retried"] = total["num_retried"]
    if "retry" in rec.details:
        rec.details["retry"]["failed_after"] = total["num_failed"]
    return {**rec.counts, **rec.details}


def _effective(out: str, stats: dict[int, dict]) -> dict[str, Any]:
    """Totals over shards with every retried URL counted once, by its latest outcome (retry.py)."""
    total = reasons.summarize(stats)
    _, old = retry.superseded(out, set(stats))
    for reason, n in old.items():
        left = total["failed_by_reason"].get(reason, 0) - n
        total["failed_by_reason"][reason] = left
        if left <= 0:
            del total["failed_by_reason"][reason]
    total["failed_by_reason"] = _by_count(total["failed_by_reason"])
    num_old = sum(old.values())
    total.update(
        num_samples=total["num_samples"] - num_old,
        num_failed=total["num_failed"] - num_old,
        num_retried=num_old,
    )
    return total


def _by_count(counts: dict[str, int]) -> dict[str, int]:
    """Most frequent first, then by name (as reasons.summarize orders them)."""
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _retry(cfg: FetchConfig, rec, out: str, with_captions: bool, num_rows: int, outcome: dict) -> dict:
    """Plan and fetch one retry round (retry.py); returns ``outcome`` with the round's shards added."""
    finished = layout.finished_shards(out)
    num_original = math.ceil(num_rows / cfg.samples_per_shard)
    if outcome["timed_out"] or not set(range(num_original)) <= finished:
        log.warning(
            "fetch: --retry-failed: nothing retried: %d of the URL list's %d shards are not finished yet; "
            "rerun the same command",
            len(set(range(num_original)) - finished),
            num_original,
        )
        return outcome
    rnd, retried, kept = retry.plan(out, finished, cfg.samples_per_shard, num_original)
    info = {
        "failed_before": sum(retried.values()) + sum(kept.values()),
        "retried_by_reason": _by_count(retried),
        "not_retried_by_reason": _by_count(kept),
        "round": None,
    }
    rec.details["retry"] = info
    if rnd is None:
        return outcome
    todo = [i for i in rnd.shard_ids if i not in finished]
    info.update(round=rnd.index, shards=[layout.shard_stem(i) for i in rnd.shard_ids])
    log.info(
        "fetch: --retry-failed: round %d: fetching %d URLs that failed transiently into shards %s..%s "
        "(%d of its shards already finished)",
        rnd.index,
        rnd.num_rows,
        layout.shard_stem(rnd.shard_ids[0]),
        layout.shard_stem(rnd.shard_ids[-1]),
        len(rnd.shard_ids) - len(todo),
    )
    retry.write_worker_list(out, rnd, f"{out}/_tmp/{retry.ROWS_FILE}", with_captions)
    spec = worker_spec(cfg, with_captions, out, finished, retry.ROWS_FILE, rnd.first_shard)
    num_urls = sum(
        min(cfg.samples_per_shard, rnd.num_rows - (i - rnd.first_shard) * cfg.samples_per_shard) for i in todo
    )
    more = download(spec, cfg.run_timeout_s, rec.lock_fd, num_urls)
    round_stats = layout.read_stats(out, set(rnd.shard_ids) & layout.finished_shards(out))
    info["round_success"] = reasons.summarize(round_stats)["num_success"]
    return {
        "num_shards_planned": outcome["num_shards_planned"] + more["num_shards_planned"],
        "timed_out": more["timed_out"],
    }


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The end-of-run summary, as logged and as the CLI prints it."""
    c, this = summary, summary["this_run"]
    lines = []
    if c["skipped_rows"]:
        skipped = ", ".join(f"{k} {v}" for k, v in c["skipped_rows"].items())
        lines.append(
            f"{c['num_rows']} rows in the list: {sum(c['skipped_rows'].values())} skipped ({skipped}; "
            "lines in the manifest's details.skipped_row_lines)"
        )
    failures = ", ".join(f"{k} {v}" for k, v in c["failed_by_reason"].items()) or "none"
    lines.append(
        f"{c['num_urls']} URLs: {c['num_success']} ok, {c['num_failed']} failed ({failures}); "
        f"{c['num_shards']} shards ({c['num_shards_resumed']} resumed)"
    )
    lines += _retry_lines(summary.get("retry"))
    if this["num_urls"] == 0:
        if not summary.get("retry"):
            lines.append("this run: nothing to download (every shard was already finished)")
        return lines
    line = (
        f"this run: {this['num_urls']} URLs in {this['wall_s']:.1f} s = {this['urls_per_s']} URLs/s, "
        f"{this['success_per_s']} images/s stored"
    )
    if this["download_urls_per_s"]:
        line += f"; downloading alone {this['download_s']:.1f} s = {this['download_urls_per_s']} URLs/s"
    return lines + [line]


def _retry_lines(info: dict | None) -> list[str]:
    """--retry-failed's before/after counts (``details.retry``)."""
    if not info:
        return []
    kept = ", ".join(f"{k} {v}" for k, v in info["not_retried_by_reason"].items()) or "none"
    if info["round"] is None and not info["failed_before"]:
        return ["retry: nothing to retry: no URL failed; nothing was changed"]
    if info["round"] is None:
        return [
            f"retry: nothing to retry: none of the {info['failed_before']} failed URLs failed for a "
            "transient "
            f"reason (permanent: {kept}); nothing was changed"
        ]
    retried = ", ".join(f"{k} {v}" for k, v in info["retried_by_reason"].items())
    return [
        f"retry round {info['round']}: fetched again {sum(info['retried_by_reason'].values())} URLs that "
        "failed "
        f"transiently ({retried}) into shards {info['shards'][0]}..{info['shards'][-1]}: "
        f"{info['round_success']} ok now; failed URLs {info['failed_before']} -> {info['failed_after']} "
        f"(not retried, permanent: {kept})"
    ]


def _report(summary: dict[str, Any]) -> None:
    for line in summary_lines(summary):
        log.info("fetch: %s", line)


def _raise_if_incomplete(cfg: FetchConfig, summary: dict[str, Any], outcome: dict) -> None:
    if outcome["timed_out"]:
        raise RuntimeError(
            f"fetch stopped after run_timeout_s={cfg.run_timeout_s}; "
            f"{summary['num_shards']} shards finished; rerun the same command to resume"
        )
    if summary["num_shards_unfinished"]:
        raise RuntimeError(
            f"{summary['num_shards_unfinished']} shards did not finish (see log.jsonl); "
            "rerun the same command to resume them"
        )
    if summary["num_success"] == 0:
        failures = (
            ", ".join(f"{k}: {v}" for k, v in summary["failed_by_reason"].items()) or "no URLs in the list"
        )
        skipped = "".join(
            f"; {n} rows skipped as {k}, e.g. {summary['skipped_row_lines'][k][0]}"
            for k, n in summary["skipped_rows"].items()
        )
        hint = (
            "; file:// URLs need allow_schemes (--allow-schemes file)"
            if "disallowed_scheme" in summary["failed_by_reason"]
            else ""
        )
        raise RuntimeError(
            f"no image downloaded from {cfg.urls} ({summary['num_urls']} URLs; {failures}{skipped}){hint}"
        )
