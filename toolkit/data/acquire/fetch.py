"""``toolkit data fetch``: download a URL list into raw webdataset shards with img2dataset.

img2dataset does the downloading, resizing and writing (:mod:`.fetch_worker` runs it in a subprocess);
this module validates the URL list, runs the download and the ``--retry-failed`` round. The config is in
:mod:`.fetch_config`; which shards already in ``out`` are kept on a rerun (rerunning resumes: finished
shards are never downloaded again) in :mod:`.fetch_resume`; the summary of successes and failures by
reason plus the throughput, written into the stage manifest (``counts`` and ``details``), in
:mod:`.fetch_summary`.
"""

from __future__ import annotations

import math
import time
from typing import Any

from toolkit.core import files
from toolkit.core.config import to_dict
from toolkit.core.log import get_logger
from toolkit.core.stage import StageResult, stage_run
from toolkit.data.acquire import fetch_summary, retry
from toolkit.data.acquire.fetch_config import KIND, ROWS_FILE, FetchConfig
from toolkit.data.acquire.fetch_process import download
from toolkit.data.acquire.fetch_resume import check_resumable, verified_shards
from toolkit.data.acquire.urllist import check_url_list, detect_format
from toolkit.data.acquire.urlrows import ListRows, read_rows, write_rows
from toolkit.data.raw import layout, reasons

log = get_logger("data.fetch")


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
        summary = fetch_summary.record(rec, out, done_before, outcome, wall_s, rows)
        fetch_summary.report(summary)
        fetch_summary.raise_if_incomplete(cfg, summary, outcome)
    return rec.result()


def _check_distributor(name: str) -> None:
    """pyspark and ray are optional cluster dependencies: say so before starting anything."""
    import importlib.util

    if name != "multiprocessing" and importlib.util.find_spec(name) is None:
        raise ValueError(
            f"distributor {name!r} needs the {name} package (pip install {name}); "
            "or use --distributor multiprocessing"
        )


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
        "retried_by_reason": fetch_summary.by_count(retried),
        "not_retried_by_reason": fetch_summary.by_count(kept),
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
