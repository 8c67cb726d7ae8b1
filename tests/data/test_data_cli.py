"""What `toolkit data` commands print: help with defaults, and summaries without 'None' or bare numbers."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from toolkit.cli.main import app
from toolkit.data.acquire.fetch_summary import summary_lines


def _help(*command: str) -> str:
    res = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    assert res.exit_code == 0, res.output
    return re.sub(r"[│╭╮╰╯─]", " ", res.output)


def test_precompute_help_shows_defaults_and_what_is_required():
    text = " ".join(_help("data", "precompute").split())
    # generated from PrecomputeConfig's fields (cli/options.ConfigOptions): each default as the config holds
    # it, what 0 means in the field's own doc
    for flag, words in [
        ("--model", "(required)"),
        ("--in", "(required)"),
        ("--out", "(required)"),
        ("--samples-per-shard", "(default: 1000)"),
        ("--workers", "0: one per CPU core"),
        ("--workers", "(default: 0)"),
        ("--resize-mode", "(default: center_crop)"),
        ("--image-size", "0: the model's image size. (default: 0)"),
        ("--image-tower", "(default: none)"),
        ("--text-tower", "(default: none)"),
    ]:
        assert re.search(rf"{re.escape(flag)} <\w+> [^<]*{re.escape(words)}", text), (flag, words)


def _summary(**this) -> dict:
    run = {
        "num_urls": 0,
        "num_success": 0,
        "wall_s": 3.2,
        "urls_per_s": 0.0,
        "success_per_s": 0.0,
        "download_s": 0.0,
        "download_urls_per_s": None,
        **this,
    }
    return {
        "num_rows": 24,
        "skipped_rows": {},
        "num_urls": 24,
        "num_success": 14,
        "num_failed": 10,
        "failed_by_reason": {"http_404": 10},
        "num_shards": 6,
        "num_shards_resumed": 6,
        "this_run": run,
    }


def test_fetch_summary_of_a_run_with_nothing_left_to_download():
    lines = summary_lines(_summary())
    assert lines == [
        "24 URLs: 14 ok, 10 failed (http_404 10); 6 shards (6 resumed)",
        "this run: nothing to download (every shard was already finished)",
    ]
    assert not any("None" in line for line in lines)
    lines = summary_lines(_summary(num_urls=4, num_success=4, urls_per_s=1.25, success_per_s=1.25))
    assert lines[-1] == "this run: 4 URLs in 3.2 s = 1.25 URLs/s, 1.25 images/s stored"  # no 'None URLs/s'
    lines = summary_lines(_summary(num_urls=4, download_s=0.5, download_urls_per_s=8.0))
    assert lines[-1].endswith("; downloading alone 0.5 s = 8.0 URLs/s")


def test_fetch_summary_of_retry_rounds():
    none = {"failed_before": 0, "retried_by_reason": {}, "not_retried_by_reason": {}, "round": None}
    assert (
        summary_lines({**_summary(), "retry": none})[-1]
        == "retry: nothing to retry: no URL failed; nothing was changed"
    )
    kept = {**none, "failed_before": 10, "not_retried_by_reason": {"http_404": 10}}
    assert summary_lines({**_summary(), "retry": kept})[-1] == (
        "retry: nothing to retry: none of the 10 failed URLs failed for a transient reason (permanent: "
        "http_404 10); "
        "nothing was changed"
    )
    done = {
        "failed_before": 12,
        "retried_by_reason": {"timeout": 2},
        "not_retried_by_reason": {"http_404": 10},
        "round": 3,
        "shards": ["00006", "00006"],
        "round_success": 1,
        "failed_after": 11,
    }
    assert summary_lines({**_summary(num_urls=2), "retry": done})[1] == (
        "retry round 3: fetched again 2 URLs that failed transiently (timeout 2) into shards 00006..00006: "
        "1 ok "
        "now; failed URLs 12 -> 11 (not retried, permanent: http_404 10)"
    )
