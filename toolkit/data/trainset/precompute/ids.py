"""Second half of ``precompute``: dense ids over every processed raw shard, in the order the storage mode
writes them.

Ids follow (raw shard in sorted order, key in sorted order); a key already kept from an earlier raw shard is
skipped as ``duplicate_key``. The parent streams: it holds one raw shard's keys and captions at a time, and
for the whole set only a 64-bit hash per kept key (``<stem>.khash``, written by the workers), sorted in place
to find the few hashes that occur more than once; only keys with such a hash are compared as strings (a
dict of those keys). That is 8 bytes per sample, where the ids used to
need ~220 bytes per sample of Python lists, tuples and a key -> shard dict.
All functions run in the parent process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np

from toolkit.data.raw.reader import shard_names
from toolkit.data.trainset.precompute.resume import stem_of
from toolkit.data.trainset.precompute.worker import ShardResult, scratch_paths

# Hashes compared per numpy call when looking for repeats: bounds the comparison's scratch memory.
CHUNK = 1 << 20


def repeated_key_hashes(results: list[ShardResult]) -> np.ndarray:
    """The sorted distinct 64-bit key hashes that occur more than once over all ``results``."""
    hashes = np.empty(sum(r.num_kept for r in results), "<u8")
    pos = 0
    for res in results:
        if res.num_kept:
            hashes[pos : pos + res.num_kept] = np.fromfile(scratch_paths(stem_of(res))["khash"], "<u8")
            pos += res.num_kept
    hashes.sort()  # in place: no second copy of the N hashes
    found = []
    for lo in range(1, len(hashes), CHUNK):  # chunked: a whole-array comparison would add 1 byte a sample
        cur = hashes[lo : lo + CHUNK]
        found.append(cur[cur == hashes[lo - 1 : lo - 1 + len(cur)]])
    return np.unique(np.concatenate(found)) if found else np.zeros(0, "<u8")


def kept_samples(
    results: list[ShardResult], skips: list[dict]
) -> Iterator[tuple[ShardResult, int, str, str]]:
    """(result, row, key, caption) of every kept sample in id order; appends every skip record to
    ``skips`` as it goes (a shard's worker skips, then its duplicate keys), in the order of skipped.jsonl."""
    repeated = repeated_key_hashes(results)
    owners: dict[int, dict[str, str]] = {}  # a repeated hash -> {key: raw shard that kept it}
    names = shard_names([r.url for r in results])
    for res in results:
        name = names[res.url]
        skips.extend({"reason": r, "shard": name, "key": k, "message": m} for r, k, m in res.skips)
        if not res.num_kept:
            continue
        paths = scratch_paths(stem_of(res))
        with open(paths["keys"], encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh]
        khash = np.fromfile(paths["khash"], "<u8")
        maybe = np.isin(khash, repeated)
        for row, digest, check in zip(
            np.fromfile(paths["order"], "<u4").tolist(), khash.tolist(), maybe.tolist(), strict=True
        ):
            key, caption = rows[row]
            if check:
                seen = owners.setdefault(digest, {})
                if key in seen:
                    skips.append(
                        {
                            "reason": "duplicate_key",
                            "shard": name,
                            "key": key,
                            "message": f"key already kept from {seen[key]}",
                        }
                    )
                    continue
                seen[key] = name
            yield res, row, key, caption
