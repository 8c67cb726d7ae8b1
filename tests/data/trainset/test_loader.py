"""The training loader: exact coverage over ranks and workers, batch shapes, readers, webdataset compatibility."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from toolkit.data.trainset.format import Field, ShardInfo, TrainDataset, read_segment, read_segment_webdataset
from toolkit.data.trainset.loader import make_loader, plan_epoch

N_SMALL = 103  # small_raw: 11 training shards of 10, the last holding 3


def _epoch(out, world, epoch, batch, workers, **kw):
    """Batches of every rank for one epoch: {rank: [batch, ...]}."""
    return {r: list(make_loader(str(out), rank=r, world_size=world, epoch=epoch, batch_size=batch,
                                num_workers=workers, **kw)) for r in range(world)}


@pytest.mark.parametrize("epoch", [0, 1])
def test_two_ranks_two_workers_see_every_sample_once(small_train, epoch):
    out, _ = small_train
    batches = _epoch(out, 2, epoch, 8, 2)
    seen = torch.cat([b["index"] for r in batches for b in batches[r]]).tolist()
    assert sorted(seen) == list(range(N_SMALL))
    for r, rank_batches in batches.items():
        loader = make_loader(str(out), rank=r, world_size=2, epoch=epoch, batch_size=8, num_workers=2)
        assert len(rank_batches) == len(loader)
        sizes = [len(b["index"]) for b in rank_batches]
        assert all(s == 8 for s in sizes[:-1]) and 1 <= sizes[-1] <= 8  # only a rank's last batch is short
        assert all(bool(b["valid"].all()) for b in rank_batches)
    per_rank = [sum(len(b["index"]) for b in batches[r]) for r in (0, 1)]
    assert sorted(per_rank) == [51, 52]


def test_batch_contents_shapes_and_dtypes(small_train):
    out, _ = small_train
    batch = next(iter(make_loader(str(out), batch_size=1, shuffle=False)))
    assert batch["image"].dtype == torch.uint8 and batch["image"].shape == (1, 32, 32, 3)
    assert batch["tokens"].dtype == torch.int64 and batch["tokens"].shape == (1, 32)
    assert batch["index"].tolist() == [0] and batch["valid"].tolist() == [True]


def test_shuffle_is_deterministic_per_epoch(small_train):
    out, _ = small_train
    order = [[b["index"].tolist() for b in make_loader(str(out), batch_size=7, epoch=e, num_workers=0)]
             for e in (0, 0, 1)]
    assert order[0] == order[1] and order[0] != order[2]
    assert sorted(sum(order[2], [])) == list(range(N_SMALL))


def test_drop_gives_equal_full_batches(small_train):
    out, _ = small_train
    batches = _epoch(out, 2, 3, 8, 2, last_batch="drop")
    assert [len(batches[r]) for r in (0, 1)] == [6, 6]
    assert all(len(b["index"]) == 8 for r in batches for b in batches[r])
    seen = torch.cat([b["index"] for r in batches for b in batches[r]]).tolist()
    assert len(set(seen)) == len(seen) == 96
    plan = make_loader(str(out), rank=0, world_size=2, epoch=3, batch_size=8, last_batch="drop").dataset.plan
    assert plan.num_dropped == N_SMALL - 96


def test_pad_gives_equal_full_batches_and_marks_copies(small_train):
    out, _ = small_train
    batches = _epoch(out, 2, 0, 8, 2, last_batch="pad")
    assert [len(batches[r]) for r in (0, 1)] == [7, 7]
    index = torch.cat([b["index"] for r in batches for b in batches[r]])
    valid = torch.cat([b["valid"] for r in batches for b in batches[r]])
    assert sorted(index[valid].tolist()) == list(range(N_SMALL))
    assert int((~valid).sum()) == 2 * 7 * 8 - N_SMALL


def _fake(sizes: list[int]) -> TrainDataset:
    shards = [ShardInfo(f"{i:05d}.tar", n, sum(sizes[:i])) for i, n in enumerate(sizes)]
    return TrainDataset(sum(sizes), [Field.make("tokens", (4,))], shards, max(sizes))


@pytest.mark.parametrize("seed", range(6))
def test_plan_covers_exactly_once_for_random_layouts(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 23, rng.integers(1, 9)).tolist()
    ds = _fake(sizes)
    for world in (1, 2, 3, 5):
        for workers in (0, 1, 2, 3):
            for batch in (1, 4, 7):
                for last in ("partial", "pad", "drop"):
                    if last == "drop" and ds.num_samples < world * batch:
                        with pytest.raises(ValueError, match="fewer than one global batch"):
                            plan_epoch(ds, rank=0, world_size=world, epoch=seed, batch_size=batch,
                                       num_workers=workers, last_batch=last)
                        continue
                    _check_plan(ds, world, workers, batch, last, seed)


def _check_plan(ds, world, workers, batch, last, epoch):
    ids, counts, padded = [], [], 0
    for rank in range(world):
        plan = plan_epoch(ds, rank=rank, world_size=world, epoch=epoch, batch_size=batch, num_workers=workers,
                          last_batch=last)
        worker_counts = [sum(s.count for s in segs) for segs in plan.workers]
        assert sum(worker_counts) == plan.num_samples
        assert all(c % batch == 0 for c in worker_counts[:-1])  # whole batches except the last worker's
        assert sum(-(-c // batch) for c in worker_counts) == plan.num_batches
        counts.append(plan.num_batches)
        for segs in plan.workers:
            for s in segs:
                assert 0 <= s.start and s.start + s.count <= ds.shards[s.shard].num_samples
                first = ds.shards[s.shard].first_id + s.start
                if s.valid:
                    ids.extend(range(first, first + s.count))
                else:
                    padded += s.count
    if last == "partial":
        assert sorted(ids) == list(range(ds.num_samples))
        assert max(counts) - min(counts) <= 1
    else:
        assert len(set(counts)) == 1 and len(ids) == len(set(ids))
        if last == "pad":
            assert sorted(ids) == list(range(ds.num_samples)) and padded < world * batch
        else:
            assert ds.num_samples - len(ids) < world * batch and padded == 0


def test_direct_and_webdataset_readers_agree(small_train):
    out, _ = small_train
    ds = TrainDataset.open(str(out))
    plan = plan_epoch(ds, rank=1, world_size=2, epoch=0, batch_size=4, num_workers=2)
    for seg in plan.workers[1]:
        a, b = list(read_segment(ds, seg)), list(read_segment_webdataset(ds, seg))
        assert [s["index"] for s in a] == [s["index"] for s in b] and len(a) == seg.count
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x["image"], y["image"])
            np.testing.assert_array_equal(x["tokens"], y["tokens"])


def test_shards_are_plain_webdataset(small_train):
    import webdataset as wds

    out, _ = small_train
    ds = TrainDataset.open(str(out))
    samples = list(wds.WebDataset(str(out / "00010.tar"), shardshuffle=False))
    assert [s["__key__"] for s in samples] == [f"{i:010d}" for i in range(100, 103)]
    direct = {s["index"]: s for seg in plan_epoch(ds, rank=0, world_size=1, epoch=0, batch_size=3,
                                                  num_workers=0, shuffle=False).workers[0]
              for s in read_segment(ds, seg)}
    for s in samples:
        pixels = np.frombuffer(s["img.u8"], np.uint8).reshape(32, 32, 3)
        np.testing.assert_array_equal(pixels, direct[int(s["__key__"])]["image"])


def test_mismatched_shard_fails_loudly(small_train, tmp_path):
    import shutil

    out, _ = small_train
    copy = tmp_path / "train"
    shutil.copytree(out, copy)
    (copy / "00003.tar").write_bytes((copy / "00004.tar").read_bytes())  # wrong shard under a right name
    with pytest.raises(ValueError, match="00003.tar"):
        list(make_loader(str(copy), batch_size=16, shuffle=False))


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers,start", [(2, 3), (3, 5), (3, 12), (0, 12), (2, 13)])
def test_start_batch_resumes_mid_epoch_exactly(small_train, workers, start):
    out, _ = small_train
    kw = dict(rank=1, world_size=2, epoch=2, batch_size=4, num_workers=workers, shuffle_buffer=16)
    full = [b["index"].tolist() for b in make_loader(str(out), **kw)]
    resumed = make_loader(str(out), start_batch=start, **kw)
    assert len(resumed) == len(full) - start
    assert [b["index"].tolist() for b in resumed] == full[start:]
