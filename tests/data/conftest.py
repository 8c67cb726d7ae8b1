"""Session fixtures of the data tests; helpers live in datakit.py (a module named conftest cannot be
imported by name reliably when several test folders have one)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from datakit import build_bad_inputs, good_samples, precompute, write_raw_shard


@pytest.fixture(scope="session")
def bad_raw(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("bad_raw")
    return root, build_bad_inputs(root)


@pytest.fixture(scope="session")
def small_raw(tmp_path_factory) -> Path:
    """Five raw shards of uneven sizes (103 good samples in all), for loader and id tests."""
    root = tmp_path_factory.mktemp("small_raw")
    rng = np.random.default_rng(7)
    for i, count in enumerate([30, 17, 25, 1, 30]):
        write_raw_shard(root / f"{i:05d}.tar", good_samples(rng, f"s{i}_", count, size=(36, 33)))
    return root


@pytest.fixture(scope="session")
def bad_train(bad_raw, tmp_path_factory):
    """The bad-input fixture set precomputed with a pool of 2 workers."""
    out = tmp_path_factory.mktemp("bad_train")
    return out, precompute(
        bad_raw[0], out, num_workers=2, samples_per_shard=7, max_truncated_share=1
    )  # its damaged tars are the point: keep what is left


@pytest.fixture(scope="session")
def small_train(small_raw, tmp_path_factory):
    """small_raw precomputed into 11 shards of 10 (the last holds 3): an awkward shard count."""
    out = tmp_path_factory.mktemp("small_train")
    return out, precompute(small_raw, out, num_workers=2, samples_per_shard=10)
