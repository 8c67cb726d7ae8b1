"""The parent's id assignment holds ~8 bytes per sample (a key hash), not the keys and captions: issue 31
measured ~220 bytes per sample (697 -> 894 MB from 1e5 to 1e6 samples) before."""

from __future__ import annotations

import tracemalloc

from toolkit.data.trainset.precompute.ids import kept_samples
from toolkit.data.trainset.precompute.worker import ShardResult, write_keys

NUM_SHARDS, PER_SHARD = 40, 5000


def _results(tmp_path) -> list[ShardResult]:
    """NUM_SHARDS processed raw shards' key files (the row files are not read here); shard 7 repeats three
    keys of shard 3, which must be skipped as duplicate_key."""
    results = []
    for i in range(NUM_SHARDS):
        keys = [f"{i:05d}{k:06d}" for k in range(PER_SHARD)][::-1]  # rows in reverse key order
        if i == 7:
            keys[:3] = ["00003000010", "00003000011", "00003000012"]
        stem = str(tmp_path / f"s{i}")
        write_keys(stem, keys, [f"a photo of thing number {k} in shard {i}" for k in range(PER_SHARD)])
        results.append(ShardResult(i, f"/raw/{i:05d}.tar", PER_SHARD, stem + ".image", stem + ".text"))
    return results


def test_ids_follow_shard_then_key_order_holding_about_8_bytes_a_sample(tmp_path):
    results, skips = _results(tmp_path), []
    tracemalloc.start()
    count, last, first_rows = 0, None, []
    for res, row, key, caption in kept_samples(results, skips):
        assert last is None or (res.index, key) > last, "ids must follow (raw shard, key) order"
        last = (res.index, key)
        if count < 2:
            first_rows.append((row, caption))
        count += 1
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    total = NUM_SHARDS * PER_SHARD
    assert count == total - 3
    assert [s["key"] for s in skips] == ["00003000010", "00003000011", "00003000012"]
    assert all(
        s["reason"] == "duplicate_key" and s["message"] == "key already kept from 00003.tar" for s in skips
    )
    assert first_rows == [
        (PER_SHARD - 1, f"a photo of thing number {PER_SHARD - 1} in shard 0"),
        (PER_SHARD - 2, f"a photo of thing number {PER_SHARD - 2} in shard 0"),
    ]
    # 8 bytes a sample for the hashes, plus one raw shard's keys and captions (~400 B a row as Python lists)
    assert peak < 8 * total + 400 * PER_SHARD + (1 << 20), peak
    assert peak > 8 * total  # the hashes are all held at once: the bound above is not vacuous
