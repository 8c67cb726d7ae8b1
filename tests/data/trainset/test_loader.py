"""The training loader: global batches independent of ranks and workers, exact resume, readers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from toolkit.data.trainset.format import TrainDataset
from toolkit.data.trainset.loader import make_loader
from toolkit.data.trainset.order import BatchOrder
from toolkit.data.trainset.segment import Segment, read_segment, read_segment_webdataset
from toolkit.data.trainset.storage.pixels import SampleReader

N_SMALL = 103  # small_raw: 11 training shards of 10, the last holding 3


def _ids(loader) -> list[list[int]]:
    return [b["index"].tolist() for b in loader]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("world,workers", [(2, 2), (4, 0), (4, 3)])
def test_ranks_and_workers_read_exactly_the_single_process_batches(small_train, world, workers):
    out, _ = small_train
    kw = dict(batch_size=8, seed=3, num_steps=30)  # 30 steps cross the pass boundary at 12 batches/pass
    single = list(make_loader(str(out), **kw))
    ranks = [
        list(make_loader(str(out), rank=r, world_size=world, num_workers=workers, **kw)) for r in range(world)
    ]
    assert [int(b["step"]) for b in ranks[0]] == list(range(30))
    for t, whole in enumerate(single):
        parts = [ranks[r][t] for r in range(world)]
        assert torch.equal(torch.cat([p["index"] for p in parts]), whole["index"])
        assert torch.equal(torch.cat([p["image"] for p in parts]), whole["image"])
        assert torch.equal(torch.cat([p["tokens"] for p in parts]), whole["tokens"])


def test_every_batch_has_distinct_ids_and_a_pass_covers_all_but_the_remainder(small_train):
    out, _ = small_train
    batches = _ids(make_loader(str(out), batch_size=8, seed=1))
    assert len(batches) == N_SMALL // 8 and all(len(set(b)) == 8 for b in batches)
    flat = sum(batches, [])
    assert len(set(flat)) == len(flat) == 96  # 103 mod 8 = 7 left out of this pass
    second = _ids(make_loader(str(out), batch_size=8, seed=1, start_step=12, num_steps=12))
    assert set(range(N_SMALL)) - set(flat) != set(range(N_SMALL)) - set(sum(second, []))
    assert batches != _ids(make_loader(str(out), batch_size=8, seed=2))


def test_batch_contents_match_the_shards(small_train):
    out, _ = small_train
    ds = TrainDataset.open(str(out))
    batch = next(iter(make_loader(str(out), batch_size=16, seed=5)))
    assert batch["image"].dtype == torch.uint8 and batch["image"].shape == (16, 32, 32, 3)
    assert batch["tokens"].dtype == torch.int64 and batch["tokens"].shape == (16, 32)
    direct = {
        s["index"]: s
        for shard in range(len(ds.shards))
        for s in read_segment(ds, Segment(shard, 0, ds.shards[shard].num_samples))
    }
    for k, sample_id in enumerate(batch["index"].tolist()):
        np.testing.assert_array_equal(batch["image"][k].numpy(), direct[sample_id]["image"])
        np.testing.assert_array_equal(batch["tokens"][k].numpy(), direct[sample_id]["tokens"])


def test_in_order_reading_sees_every_sample_once(small_train):
    out, _ = small_train
    batches = _ids(make_loader(str(out), batch_size=10, shuffle=False, num_workers=2))
    assert sum(batches, []) == list(range(N_SMALL)) and len(batches[-1]) == 3
    with pytest.raises(ValueError, match="one process"):
        list(make_loader(str(out), batch_size=10, shuffle=False, world_size=2))


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers,start", [(2, 3), (3, 5), (0, 12), (2, 13)])
def test_resume_at_any_step_and_worker_count(small_train, workers, start):
    out, _ = small_train
    full = _ids(
        make_loader(str(out), batch_size=4, rank=1, world_size=2, seed=7, num_steps=30, num_workers=2)
    )
    resumed = make_loader(
        str(out),
        batch_size=4,
        rank=1,
        world_size=2,
        seed=7,
        start_step=start,
        num_steps=30 - start,
        num_workers=workers,
    )
    assert len(resumed) == 30 - start
    assert _ids(resumed) == full[start:]


def test_sample_reader_keeps_order_and_refuses_unknown_ids(small_train):
    out, _ = small_train
    ds = TrainDataset.open(str(out))
    reader = SampleReader(ds)
    ids = np.array([102, 5, 6, 7, 99, 0, 50], dtype=np.int64)
    got = reader.read(ids)
    for k, sample_id in enumerate(ids.tolist()):
        shard, pos = divmod(sample_id, 10)
        want = next(read_segment(ds, Segment(shard, pos, 1)))
        np.testing.assert_array_equal(got["image"][k], want["image"])
    with pytest.raises(IndexError, match="103"):
        reader.read(np.array([103]))
    reader.close()


def test_block_shuffle_reads_runs_and_still_covers_the_pass(small_train):
    out, _ = small_train
    order = BatchOrder(N_SMALL, 8, seed=0, block=5)
    batches = _ids(make_loader(str(out), batch_size=8, seed=0, block=5))
    assert batches == [order.batch_ids(t).tolist() for t in range(len(batches))]
    assert len(set(sum(batches, []))) == 96


def test_direct_and_webdataset_readers_agree(small_train):
    out, _ = small_train
    ds = TrainDataset.open(str(out))
    for seg in (Segment(0, 0, 10), Segment(4, 3, 5), Segment(10, 0, 3)):
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
    direct = {s["index"]: s for s in read_segment(ds, Segment(10, 0, 3))}
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
