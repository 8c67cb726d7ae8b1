"""Precompute's stage manifest: counts by skip reason and conversion, throughput, examples of skipped keys
(the first of each reason, at most ``MAX_KEYS_PER_REASON`` of each), the damaged raw tars."""

from __future__ import annotations

from collections import Counter

from toolkit.data.raw.reader import shard_names
from toolkit.data.trainset.format import DATASET_JSON
from toolkit.data.trainset.truncation import first_skips

# The manifest lists at most this many skipped keys per reason; skipped.jsonl has all of them.
MAX_KEYS_PER_REASON = 1000


def record(
    rec, urls: list[str], results, num_samples: int, skips, timing: dict, with_reference: bool
) -> None:
    """Write the counts (``rec.counts``) and throughput, skipped keys and tar errors (``rec.details``) of a
    run that kept ``num_samples`` of the raw shards ``urls`` (``results``: their ``ShardResult``s; ``skips``:
    every skip record); RuntimeError when read, kept and skipped do not add up."""
    by_reason = Counter(s["reason"] for s in skips)
    converted, names = sum((r.converted for r in results), Counter()), shard_names(urls)
    num_read = sum(r.num_read for r in results)
    read_now = num_read - timing["num_resumed_samples"]  # rates are of this run's work, not a resumed run's
    if num_read != num_samples + len(skips):
        raise RuntimeError(
            f"internal count mismatch: read {num_read}, kept {num_samples}, skipped {len(skips)}"
        )
    examples: dict[str, list[str]] = {}
    first = first_skips((s["reason"], s["shard"], s["key"], s["message"]) for s in skips)
    for s in skips:
        lst = examples.setdefault(s["reason"], [])
        if len(lst) < MAX_KEYS_PER_REASON:
            lst.append(f"{s['shard']}:{s['key']}")
    total_s = timing["process_s"] + timing["write_s"]
    rec.counts.update(
        {
            "num_samples": num_samples,
            "num_read": num_read,
            "num_skipped": len(skips),
            "num_raw_shards": len(urls),
            "num_shards": timing["num_shards"],
            "num_damaged_tars": sum(1 for r in results if r.tar_error),
            "skipped": dict(sorted(by_reason.items())),
            "converted": dict(sorted(converted.items())),
            "num_captions_cut": sum(r.num_captions_cut for r in results),
            "samples_per_s": round(read_now / max(total_s, 1e-9), 1),
        }
    )
    rec.details.update(
        {
            "throughput": {
                **timing,
                "process_samples_per_s": round(read_now / max(timing["process_s"], 1e-9), 1),
                # worker-seconds of the reference pass, summed over raw shards (resumed ones included)
                **({"reference_s": round(sum(r.reference_s for r in results), 3)} if with_reference else {}),
                "write_samples_per_s": round(num_samples / max(timing["write_s"], 1e-9), 1),
            },
            "skipped_keys": examples,
            "skipped_first": dict(sorted(first.items())),
            "tar_errors": {names[r.url]: r.tar_error for r in results if r.tar_error},
            "dataset": DATASET_JSON,
            "skipped_file": "skipped.jsonl",
        }
    )
