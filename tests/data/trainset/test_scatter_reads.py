"""Pixels sets on a local disk are read straight into batch order (toolkit.data.trainset.scatter: preadv into
each sample's rows): the batches equal the portable read-and-gather path's byte for byte, and every
integrity check still fires."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from toolkit.data.trainset import integrity
from toolkit.data.trainset.format import TrainDataset
from toolkit.data.trainset.loader import InOrder, make_loader
from toolkit.data.trainset.order import BatchOrder
from toolkit.data.trainset.segment import field_offsets, open_shard
from toolkit.data.trainset.storage import pixels
from toolkit.data.trainset.storage.pixels import SampleReader

N_SMALL = 103  # small_train: 11 shards of 10, the last holding 3


@pytest.fixture()
def train_copy(small_train, tmp_path) -> Path:
    out = tmp_path / "train"
    shutil.copytree(small_train[0], out)
    return out


def _flip(path: Path, offset: int, count: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + count] = bytes(b ^ 0xFF for b in data[offset : offset + count])
    path.write_bytes(bytes(data))


def _orders() -> dict[str, tuple[object, int]]:
    """Batch orders and how many batches of each to read (two passes where a pass is short)."""
    return {
        "shuffled": (BatchOrder(N_SMALL, 8, seed=3), 26),
        "in_order": (InOrder(N_SMALL, 10, 0), 11),
        "block": (BatchOrder(N_SMALL, 8, seed=1, block=5), 26),
        "batch_1": (BatchOrder(N_SMALL, 1, seed=2), 120),
        "whole_set": (InOrder(N_SMALL, N_SMALL, 0), 1),
    }


@pytest.mark.parametrize("order_name", list(_orders()))
def test_scatter_and_seeking_reads_give_identical_batches(small_train, order_name):
    ds = TrainDataset.open(str(small_train[0]))
    order, num_batches = _orders()[order_name]
    scatter, seeking = SampleReader(ds, scatter=True), SampleReader(ds, scatter=False)
    assert scatter._scatter is not None and seeking._scatter is None
    try:
        for t in range(num_batches):
            ids = order.batch_ids(t)
            got, want = scatter.read(ids), seeking.read(ids)
            assert list(got) == list(want) == ["image", "tokens"]
            for role, array in want.items():
                assert got[role].dtype == array.dtype and got[role].shape == array.shape
                assert got[role].flags.c_contiguous and array.flags.c_contiguous
                np.testing.assert_array_equal(got[role], array)
    finally:
        scatter.close()
        seeking.close()


def test_local_sets_scatter_by_default_and_workers_read_the_same(small_train):
    ds = TrainDataset.open(str(small_train[0]))
    assert SampleReader(ds)._scatter is not None  # a local folder
    kw = dict(batch_size=8, seed=4, num_steps=14)
    single = list(make_loader(str(small_train[0]), **kw))
    forked = list(make_loader(str(small_train[0]), num_workers=2, **kw))  # each worker opens its own files
    reader = SampleReader(ds, scatter=False)
    for a, b in zip(single, forked, strict=True):
        want = reader.read(a["index"].numpy())
        assert (a["index"] == b["index"]).all()
        np.testing.assert_array_equal(a["image"].numpy(), want["image"])
        np.testing.assert_array_equal(b["image"].numpy(), want["image"])
        np.testing.assert_array_equal(b["tokens"].numpy(), want["tokens"].astype(np.int64))


@pytest.mark.parametrize("where", ["pixels", "member_name"])
def test_a_damaged_byte_is_named_on_the_scatter_path_as_on_the_seeking_path(train_copy, where):
    ds = TrainDataset.open(str(train_copy))
    offset = field_offsets(ds)[0] + 100 if where == "pixels" else 3  # inside the image, or its member's name
    _flip(train_copy / "00004.tar", 6 * ds.sample_bytes + offset, 1)
    ids = np.array([80, 46, 3, 45], dtype=np.int64)
    messages = []
    for scatter in (True, False):
        with pytest.raises(integrity.DataIntegrityError if where == "pixels" else ValueError) as err:
            SampleReader(ds, scatter=scatter).read(ids)
        messages.append(str(err.value))
    assert messages[0] == messages[1]
    if where == "pixels":
        assert "00004.tar: sample 6 (id 46) is damaged: its checksum does not match" in messages[0]
    else:
        assert "00004.tar: sample 6 is" in messages[0] and "expected '0000000046.img.u8'" in messages[0]
    SampleReader(ds, scatter=True).read(np.array([45, 47, 80]))  # its neighbours still read


def test_a_misnamed_member_is_caught_without_checksums(train_copy):
    """A folder precomputed before checksums: the scatter path checks every sample's member name itself."""
    ds = TrainDataset.open(str(train_copy))
    unverified = TrainDataset(
        ds.num_samples,
        ds.fields,
        [type(s)(s.name, s.num_samples, s.first_id) for s in ds.shards],
        ds.samples_per_shard,
        root=ds.root,
    )
    _flip(train_copy / "00002.tar", 3 * ds.sample_bytes + 5, 1)
    integrity._NOTICED.add(ds.root)  # the notice is not what this test is about
    SampleReader(unverified, scatter=True).read(
        np.array([20, 22, 24])
    )  # other samples of the shard still read
    with pytest.raises(ValueError, match=r"00002.tar: sample 3 is .*expected '0000000023.img.u8'"):
        SampleReader(unverified, scatter=True).read(np.array([50, 23]))


def test_a_truncated_shard_is_refused_when_opened_naming_file_and_sizes(train_copy):
    """The size is checked when the shard is opened, so even its intact first samples are refused."""
    ds = TrainDataset.open(str(train_copy))
    shard = train_copy / "00007.tar"
    size = 4 * ds.sample_bytes + 700
    shard.write_bytes(shard.read_bytes()[:size])
    reader = SampleReader(ds, scatter=True)
    reader.read(np.array([1, 69, 80]))
    with pytest.raises(integrity.DataIntegrityError) as err:
        reader.read(np.array([70, 5]))  # sample 0 of the shard lies within the bytes left
    assert str(err.value).startswith(
        f"{shard}: {size} bytes, shorter than the {10 * ds.sample_bytes} bytes "
        f"dataset.json says (10 samples of {ds.sample_bytes} bytes; cut off from "
        "sample 4)"
    )
    reader.close()


def test_a_shard_cut_short_while_open_fails_naming_the_sample(train_copy):
    ds = TrainDataset.open(str(train_copy))
    reader = SampleReader(ds, scatter=True)
    reader.read(np.array([70]))  # opened whole
    shard = train_copy / "00007.tar"
    shard.write_bytes(shard.read_bytes()[: 4 * ds.sample_bytes + 700])  # in place: the open file shrinks
    reader.read(np.array([73]))
    with pytest.raises(
        ValueError, match=r"00007.tar: ended inside sample 4 \(dataset.json says 10 samples\)"
    ):
        reader.read(np.array([74, 2]))
    reader.close()


def test_at_most_max_open_files_stay_open(small_train, monkeypatch):
    opened = []

    def open_and_record(ds, shard):
        opened.append(open_shard(ds, shard))
        return opened[-1]

    monkeypatch.setattr(pixels, "MAX_OPEN_FILES", 3)
    monkeypatch.setattr(pixels, "open_shard", open_and_record)
    ds = TrainDataset.open(str(small_train[0]))
    reader = SampleReader(ds, scatter=True)
    for ids in np.array_split(np.random.default_rng(0).permutation(N_SMALL), 9):
        reader.read(ids)
        assert len(reader._open) <= 3 and sum(not fh.closed for fh in opened) <= 3
    assert {Path(fh.name).name for fh in opened} == {s.name for s in ds.shards}
    reader.close()
    assert all(fh.closed for fh in opened)


def test_partial_preadv_calls_are_continued(small_train, monkeypatch):
    """POSIX lets preadv return fewer bytes than asked before the end of a file: the reader asks again for
    the rest (here the real preadv is handed at most 1000 bytes of buffers a call)."""
    from toolkit.data.trainset import scatter as scatter_module

    real, calls = scatter_module.os.preadv, []

    def at_most_1000_bytes(fd, buffers, offset):
        kept, left = [], 1000
        for buf in buffers:
            if left == 0:
                break
            kept.append(buf[:left])
            left -= len(kept[-1])
        calls.append(offset)
        return real(fd, kept, offset)

    ds = TrainDataset.open(str(small_train[0]))
    ids = np.array([12, 13, 14, 50, 7], dtype=np.int64)
    want = SampleReader(ds, scatter=False).read(ids)
    monkeypatch.setattr(scatter_module.os, "preadv", at_most_1000_bytes)
    got = SampleReader(ds, scatter=True).read(ids)
    assert len(calls) > 5 * ds.sample_bytes // 1000
    for role, array in want.items():
        np.testing.assert_array_equal(got[role], array)


def test_an_empty_id_list_reads_empty_fields(small_train):
    ds = TrainDataset.open(str(small_train[0]))
    got = SampleReader(ds, scatter=True).read(np.array([], dtype=np.int64))
    assert got["image"].shape == (0, *ds.field("image").shape) and got["tokens"].shape == (0, 32)
