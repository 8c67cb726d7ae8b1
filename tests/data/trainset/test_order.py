"""The global-batch order: a bijection per pass, distinct ids per batch, independent of ranks."""

from __future__ import annotations

import numpy as np
import pytest

from toolkit.data.trainset.order import BatchOrder, permute


@pytest.mark.parametrize("size", [1, 2, 3, 5, 17, 64, 1000, 4099])
def test_permute_is_a_bijection_that_depends_on_seed_and_pass(size):
    values = np.arange(size)
    out = permute(values, size, seed=7, pass_index=3)
    assert sorted(out.tolist()) == list(range(size))
    if size > 16:
        assert not np.array_equal(out, values)
        assert not np.array_equal(out, permute(values, size, seed=7, pass_index=4))
        assert not np.array_equal(out, permute(values, size, seed=8, pass_index=3))
        assert np.array_equal(out, permute(values, size, seed=7, pass_index=3))  # deterministic


@pytest.mark.parametrize("n,b,block", [(1003, 64, 1), (1003, 64, 8), (257, 2, 1), (96, 96, 5), (10, 3, 4)])
def test_each_pass_is_distinct_ids_and_drops_a_different_remainder(n, b, block):
    order = BatchOrder(n, b, seed=5, block=block)
    seen_dropped = []
    for p in range(3):
        batches = [order.batch_ids(p * order.batches_per_pass + j) for j in range(order.batches_per_pass)]
        ids = np.concatenate(batches)
        assert all(len(set(x.tolist())) == b for x in batches)
        assert len(set(ids.tolist())) == len(ids) == order.batches_per_pass * b
        assert ids.min() >= 0 and ids.max() < n
        seen_dropped.append(frozenset(range(n)) - set(ids.tolist()))
    if order.dropped_per_pass:
        assert len(set(seen_dropped)) > 1  # the left-out samples change from pass to pass


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_slices_concatenate_to_the_global_batch(world):
    order = BatchOrder(1000, 12, seed=1, block=3)
    for t in (0, 1, 82, 83, 200):
        whole = order.batch_ids(t)
        parts = [order.batch_ids(t, r, world) for r in range(world)]
        assert np.array_equal(np.concatenate(parts), whole)


def test_blocks_are_read_as_runs_of_consecutive_ids():
    order = BatchOrder(10_000, 256, seed=2, block=16)
    ids = order.batch_ids(3)
    runs = np.split(ids, np.flatnonzero(np.diff(ids) != 1) + 1)
    assert np.mean([len(r) for r in runs]) >= 8  # mostly whole blocks (a rotation may split one at n)


def test_refuses_batches_that_do_not_fit():
    with pytest.raises(ValueError, match="larger than the dataset"):
        BatchOrder(10, 11)
    with pytest.raises(ValueError, match="divide by the number of ranks"):
        BatchOrder(100, 10).batch_ids(0, 0, 3)
