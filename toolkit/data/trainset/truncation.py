"""Refuse to precompute over a failed fetch (too many samples lost to truncated or unreadable raw shards), or
over raw shards that gave no sample at all.

A fetch cut short by a full disk leaves raw shards that end mid-tar; precompute keeps every intact sample
and counts the rest (``truncated_tar``, ``unreadable_tar``, ``missing_from_tar``). Keeping 117 of 400
samples and exiting 0 trains on a quarter of the data without anyone noticing, so losing more than
``max_truncated_share`` of the samples read to such damage is an error naming the shards (the damage of
one shard in a large set stays a counted warning). Called by ``precompute.run`` before shards are written.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

# Skip reasons that mean the raw shard itself is damaged, not the sample.
TRUNCATION_REASONS = frozenset({"truncated_tar", "unreadable_tar", "missing_from_tar"})
MAX_NAMED = 10  # shards named in the error; the count says how many more


def check_truncation(skips: list[dict], num_read: int, max_share: float, source: str) -> None:
    """ValueError when the samples lost to damaged raw shards are more than ``max_share`` of ``num_read``.

    ``skips``: precompute's skip records ({reason, shard, key, message}); ``source``: the input, for the
    message.
    """
    lost = Counter(s["shard"] for s in skips if s["reason"] in TRUNCATION_REASONS)
    num_lost = sum(lost.values())
    if num_read <= 0 or num_lost / num_read <= max_share:
        return
    named = ", ".join(f"{shard} ({n} lost)" for shard, n in sorted(lost.items())[:MAX_NAMED])
    more = f" and {len(lost) - MAX_NAMED} more shards" if len(lost) > MAX_NAMED else ""
    listed = sum(1 for s in skips if s["reason"] == "missing_from_tar")  # whole tars, sidecars promising more
    stale = (
        f"; {listed} of them are listed in a shard's .parquet or _stats.json but absent from a tar that ends "
        "cleanly: if those tars were filtered or rewritten on purpose, delete their stale .parquet and "
        "_stats.json"
        if listed
        else ""
    )
    raise ValueError(
        f"{source}: {num_lost} of {num_read} samples ({100 * num_lost / num_read:.1f} %) are lost to "
        f"truncated or unreadable raw shards, more than max_truncated_share={max_share:g}: {named}"
        f"{more}{stale}; fetch them again (a rerun of data fetch resumes), or set max_truncated_share=1 "
        "to keep what is left"
    )


def check_some_kept(shards: list[tuple[str, int, list[tuple[str, str, str]]]], source: str) -> None:
    """ValueError when no raw shard kept a sample, with the skip counts by reason and the first skip of each
    of up to three reasons (shard, key, message): the message is what says why (a caption only in .json,
    members apart in the tar). ``shards``: (shard name, samples kept, skips as (reason, key, message)) per raw
    shard."""
    if any(num_kept for _, num_kept, _ in shards):
        return
    reasons = ", ".join(
        f"{k}: {v}" for k, v in Counter(s[0] for _, _, skips in shards for s in skips).items()
    )
    firsts = first_skips(
        (reason, name, key, message) for name, _, skips in shards for reason, key, message in skips
    )
    example = "; e.g. " + "; ".join(list(firsts.values())[:3]) if firsts else ""
    raise ValueError(
        f"{source}: no valid sample in {len(shards)} raw shard(s) ({reasons or 'empty'}){example}"
    )


def first_skips(skips: Iterable[tuple[str, str, str, str]]) -> dict[str, str]:
    """Reason -> "SHARD key 'KEY': MESSAGE" of its first skip, from skips as (reason, shard name, key,
    message): the message says why (and often what to do). Each reason's line is formatted once."""
    first: dict[str, str] = {}
    for reason, shard, key, message in skips:
        if reason not in first:
            first[reason] = f"{shard} key {key!r}: {message}"
    return first
