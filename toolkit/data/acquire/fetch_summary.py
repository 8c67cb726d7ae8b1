"""``toolkit data fetch``'s summary: successes and failures by reason, the throughput, the retry round's
before and after, recorded into the stage manifest (``counts`` and ``details``), logged, printed by the CLI,
and the errors of a run that left shards unfinished or downloaded nothing."""

from __future__ import annotations

from typing import Any

from toolkit.core.log import get_logger
from toolkit.data.acquire import retry
from toolkit.data.acquire.fetch_config import FetchConfig
from toolkit.data.acquire.urlrows import ListRows
from toolkit.data.raw import layout, reasons

log = get_logger("data.fetch")


def record(
    rec, out: str, done_before: set[int], outcome: dict, wall_s: float, rows: ListRows
) -> dict[str, Any]:
    """Write the run's counts (every shard, retried URLs once) and this run's throughput into ``rec``;
    returns counts and details merged, as :func:`summary_lines` reads them."""
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
    total["failed_by_reason"] = by_count(total["failed_by_reason"])
    num_old = sum(old.values())
    total.update(
        num_samples=total["num_samples"] - num_old,
        num_failed=total["num_failed"] - num_old,
        num_retried=num_old,
    )
    return total


def by_count(counts: dict[str, int]) -> dict[str, int]:
    """Most frequent first, then by name (as reasons.summarize orders them)."""
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


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


def report(summary: dict[str, Any]) -> None:
    """Log :func:`summary_lines`."""
    for line in summary_lines(summary):
        log.info("fetch: %s", line)


def raise_if_incomplete(cfg: FetchConfig, summary: dict[str, Any], outcome: dict) -> None:
    """RuntimeError for a run stopped by ``run_timeout_s``, with shards left unfinished, or without images."""
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
