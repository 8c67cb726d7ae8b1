"""Random crops of training pixels: drawn from (seed, step, id), so ranks, workers and resumes replay them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datakit import MODEL, good_samples, precompute, write_raw_shard
from PIL import Image

from toolkit.data import augment
from toolkit.data.augment import AugmentConfig, PixelTransform, crop_draws
from toolkit.data.decode import crop_box
from toolkit.data.images import stored_side
from toolkit.data.trainset.format import TrainDataset
from toolkit.data.trainset.loader import make_loader

SIZE = 32  # cliptk-tiny's image side


@pytest.fixture(scope="module")
def margin_train(tmp_path_factory):
    """40 real JPEG pairs precomputed with the default crop margin (stored 36 px for the model's 32)."""
    raw = tmp_path_factory.mktemp("aug_raw")
    rng = np.random.default_rng(11)
    write_raw_shard(raw / "00000.tar", good_samples(rng, "a", 23, size=(61, 47)))
    write_raw_shard(raw / "00001.tar", good_samples(rng, "b", 17, size=(40, 52)))
    out = tmp_path_factory.mktemp("aug_train")
    from toolkit.core.config import build
    from toolkit.data.trainset.precompute.stage import PrecomputeConfig, run

    run(build(PrecomputeConfig, {"input": str(raw), "out": str(out), "model": MODEL, "samples_per_shard": 9}))
    return out


def test_precompute_stores_the_crop_margin(margin_train):
    ds = TrainDataset.open(str(margin_train))
    assert ds.field("image").shape == (36, 36, 3) == (stored_side(SIZE, 0.9),) * 2 + (3,)
    assert ds.extra["image_size"] == SIZE and ds.extra["crop_scale_min"] == 0.9
    assert stored_side(224, 0.9) == 249 and stored_side(224, 1.0) == 224


def test_margin_is_enough_that_no_crop_upsamples():
    cfg = AugmentConfig()
    draws = crop_draws(cfg, seed=3, step=0, ids=np.arange(20000))
    side = stored_side(224, cfg.scale_min)
    boxes = np.array([crop_box(side, side, d) for d in draws])
    assert boxes[:, 2].min() >= 224 and boxes[:, 3].min() >= 224
    ratios = boxes[:, 2] / boxes[:, 3]
    assert ratios.min() < 0.95 and ratios.max() > 1.05  # aspect ratios do vary (clamped to what fits)


def test_draws_depend_on_seed_step_and_id_only():
    cfg = AugmentConfig()
    ids = np.array([5, 900, 3, 77])
    a = crop_draws(cfg, 1, 10, ids)
    assert np.array_equal(a[1:3], crop_draws(cfg, 1, 10, ids[1:3]))  # another slice: the same per-id draws
    assert not np.array_equal(a, crop_draws(cfg, 1, 11, ids)) and not np.array_equal(
        a, crop_draws(cfg, 2, 10, ids)
    )
    assert (a[:, 0] >= 0.9).all() and (a[:, 0] <= 1.0).all()
    assert (a[:, 1] >= 0.75).all() and (a[:, 1] <= 4 / 3).all()
    big = crop_draws(cfg, 0, 0, np.arange(100000))
    assert abs(big[:, 2].mean() - 0.5) < 0.01 and abs(np.log(big[:, 1]).mean()) < 0.01  # uniform, log-uniform


def _batches(data, **kw):
    transform = PixelTransform(SIZE, seed=4, augment=AugmentConfig())
    loader = make_loader(str(data), batch_size=8, seed=4, image_transform=transform, **kw)
    return [(b["step"], b["index"].clone(), b["image"].clone()) for b in loader]


def _same_across_ranks_and_resume(read, margin_train) -> list:
    """``read``'s batches from one process, from 2 ranks (concatenated) and after a resume at step 5 hold the
    same ids and pixels; returns the one-process batches."""
    one = read(margin_train, num_steps=8)
    ranks = [read(margin_train, num_steps=8, rank=r, world_size=2, num_workers=2) for r in (0, 1)]
    for t, (_, ids, img) in enumerate(one):
        assert torch.equal(torch.cat([ranks[0][t][1], ranks[1][t][1]]), ids)
        assert torch.equal(torch.cat([ranks[0][t][2], ranks[1][t][2]]), img)
    resumed = read(margin_train, start_step=5, num_steps=3, num_workers=2)
    for (s1, i1, img1), (s2, i2, img2) in zip(one[5:], resumed, strict=True):
        assert s1 == s2 and torch.equal(i1, i2) and torch.equal(img1, img2)
    return one


def test_one_process_two_ranks_and_resume_see_the_same_pixels(margin_train):
    one = _same_across_ranks_and_resume(_batches, margin_train)
    assert all(img.shape == (8, SIZE, SIZE, 3) and img.dtype == torch.uint8 for _, _, img in one)
    # an id seen again in a later pass is cropped differently: augmentation, not a fixed crop per sample
    later = _batches(margin_train, start_step=5, num_steps=8)
    first = {int(i): img for _, ids, imgs in one for i, img in zip(ids, imgs, strict=True)}
    again = [
        (first[int(i)], img)
        for _, ids, imgs in later
        for i, img in zip(ids, imgs, strict=True)
        if int(i) in first
    ]
    assert again and sum(not torch.equal(a, b) for a, b in again) >= len(again) // 2


def test_crop_matches_pillow_on_the_stored_pixels(margin_train):
    ds = TrainDataset.open(str(margin_train))
    loader = make_loader(
        ds, batch_size=8, seed=4, num_steps=1, image_transform=PixelTransform(SIZE, 4, AugmentConfig())
    )
    batch = next(iter(loader))
    stored = make_loader(ds, batch_size=8, seed=4, num_steps=1)
    raw = next(iter(stored))["image"].numpy()
    draws = crop_draws(AugmentConfig(), 4, 0, batch["index"].numpy())
    for k in range(8):
        left, top, w, h = crop_box(36, 36, draws[k])
        ref = Image.fromarray(raw[k]).resize(
            (SIZE, SIZE), Image.Resampling.BICUBIC, box=(left, top, left + w, top + h)
        )
        diff = np.abs(batch["image"][k].numpy().astype(int) - np.asarray(ref, int))
        assert diff.mean() < 0.5 and diff.max() <= 4  # torch's antialiased bicubic is Pillow's filter


def test_off_resizes_the_stored_square_and_old_sets_still_crop(margin_train, tmp_path):
    ds = TrainDataset.open(str(margin_train))
    off = augment.pixel_transform(AugmentConfig(random_crop=False), (36, 36, 3), SIZE, 0)
    assert off is not None and off.augment is None  # the margin still has to go
    assert augment.pixel_transform(AugmentConfig(random_crop=False), (32, 32, 3), SIZE, 0) is None
    assert augment.pixel_transform(AugmentConfig(), None, SIZE, 0) is None  # frozen-tower features
    batch = next(iter(make_loader(ds, batch_size=8, seed=4, num_steps=1, image_transform=off)))
    assert batch["image"].shape == (8, SIZE, SIZE, 3)
    # a set precomputed before the margin (stored at the model's side) crops within what is there
    old = tmp_path / "old"
    precompute(ds.source, old, crop_scale_min=1.0)
    assert TrainDataset.open(str(old)).field("image").shape == (SIZE, SIZE, 3)
    on = augment.pixel_transform(AugmentConfig(), (SIZE, SIZE, 3), SIZE, 0)
    old_batch = next(iter(make_loader(str(old), batch_size=8, seed=4, num_steps=1, image_transform=on)))
    assert old_batch["image"].shape == (8, SIZE, SIZE, 3)


def test_trainer_crops_by_default_and_not_for_features(margin_train):
    from toolkit.core.config import build
    from toolkit.data.trainset.format import TrainDataset
    from toolkit.train.batches import TrainData
    from toolkit.train.config import TrainConfig
    from toolkit.train.runtime import Runtime

    cfg = build(
        TrainConfig, {"data": str(margin_train), "out": "unused", "model": MODEL, "batch_size": 8, "steps": 2}
    )
    rt = Runtime(rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
    data = TrainData(cfg.data_plan(), rt, TrainDataset.open(str(margin_train)))
    assert data.image_transform == PixelTransform(SIZE, cfg.seed, AugmentConfig())
    batch = next(data.batches(0))
    assert batch["image"].shape == (8, SIZE, SIZE, 3)


# --- the crop's resize on the training device (augment.crop_on): the loader sends stored pixels + boxes ---


def _device_batches(data, **kw):
    """Like _batches, with the loader drawing only the boxes and resize_crops doing the crop afterwards."""
    transform = augment.DeviceCrop(SIZE, seed=4, augment=AugmentConfig())
    loader = make_loader(str(data), batch_size=8, seed=4, image_transform=transform, **kw)
    out = []
    for b in loader:
        assert b["image"].shape == (len(b["index"]), 36, 36, 3) and b["crop_box"].shape == (
            len(b["index"]),
            4,
        )
        out.append((b["step"], b["index"].clone(), augment.resize_crops(b["image"], b["crop_box"], SIZE)))
    return out


def test_device_crop_equals_the_loader_crop(margin_train):
    loader, device = _batches(margin_train, num_steps=5), _device_batches(margin_train, num_steps=5)
    for (s1, i1, img1), (s2, i2, img2) in zip(loader, device, strict=True):
        assert s1 == s2 and torch.equal(i1, i2) and img2.shape == img1.shape and img2.dtype == torch.uint8
        diff = (img1.int() - img2.int()).abs()
        assert (
            diff.max() <= 2 and diff.float().mean() < 0.05
        )  # torch's uint8 path: 16-bit fixed-point weights


@pytest.mark.parametrize(("stored", "size", "scale_min"), [(249, 224, 0.9), (36, 32, 0.3), (20, 32, 0.9)])
def test_batched_resize_matches_torch_uint8_resize_on_noise(stored, size, scale_min):
    """Noise overshoots the bicubic kernel past 0 and 255: the passes must clip as the uint8 path does;
    crops larger and smaller than the output (shrink and enlarge) and the whole image (no draws)."""
    rng = np.random.default_rng(5)
    n = augment.RESIZE_CHUNK + 6  # two chunks, the second one short
    images = rng.integers(0, 256, (n, stored, stored, 3), dtype=np.uint8)
    for draws in (crop_draws(AugmentConfig(scale_min=scale_min), 0, 2, np.arange(n)), None):
        ref = augment.crop_pixels(images, size, draws)
        boxes = torch.from_numpy(augment.crop_boxes(stored, stored, draws, n))
        got = augment.resize_crops(torch.from_numpy(images), boxes, size)
        diff = (ref.int() - got.int()).abs()
        assert got.shape == ref.shape and diff.max() <= 2 and diff.float().mean() < 0.02


def _varied_boxes(rng, n: int, stored: int) -> np.ndarray:
    """int64 [n, 4] boxes in a stored x stored image, 6 px to the whole side: shrinking 60 -> 24 px takes
    up to 11 taps a row, so the batch's widest row pads most samples' taps."""
    width, height = rng.integers(6, stored + 1, n), rng.integers(6, stored + 1, n)
    left, top = rng.integers(0, stored - width + 1), rng.integers(0, stored - height + 1)
    return np.stack([left, top, width, height], axis=1).astype(np.int64)


def _resize_per_chunk(images: torch.Tensor, boxes: np.ndarray, size: int) -> torch.Tensor:
    """resize_crops with each chunk's taps built from that chunk's boxes alone (how it was first written)."""
    out = []
    for lo in range(0, len(boxes), augment.RESIZE_CHUNK):
        part = boxes[lo : lo + augment.RESIZE_CHUNK]
        cols, rows = (augment.resize_taps(part[:, axis], part[:, axis + 2], size)[:2] for axis in (0, 1))
        chw = images[lo : lo + augment.RESIZE_CHUNK].permute(0, 3, 1, 2).float()
        done = augment._resize_last(chw, torch.from_numpy(cols[0]), torch.from_numpy(cols[1]).float())
        done = augment._resize_last(
            done.transpose(2, 3), torch.from_numpy(rows[0]), torch.from_numpy(rows[1]).float()
        )
        out.append(done.to(torch.uint8).permute(0, 3, 2, 1))
    return torch.cat(out)


@pytest.mark.parametrize("n", [2 * augment.RESIZE_CHUNK + 3, 1])
def test_batch_taps_equal_per_chunk_taps(n):
    """resize_crops builds the whole batch's taps at once and slices them per chunk: the pixels are the
    ones per-chunk taps give, bit for bit, and a sample's taps do not depend on the others' widths."""
    rng = np.random.default_rng(3)
    stored, size = 60, 24
    images = torch.from_numpy(rng.integers(0, 256, (n, stored, stored, 3), dtype=np.uint8))
    boxes = _varied_boxes(rng, n, stored)
    got = augment.resize_crops(images, torch.from_numpy(boxes), size)
    assert got.shape == (n, size, size, 3) and torch.equal(got, _resize_per_chunk(images, boxes, size))
    idx, w, used = augment.resize_taps(boxes[:, 0], boxes[:, 2], size)
    assert used.max() == idx.shape[2] and (n == 1 or used.min() < used.max())
    for k in range(n):
        alone_idx, alone_w, alone_used = augment.resize_taps(boxes[k : k + 1, 0], boxes[k : k + 1, 2], size)
        assert alone_used[0] == used[k] == alone_w.shape[2] and not w[k, :, used[k] :].any()
        assert np.array_equal(alone_w[0], w[k, :, : used[k]]) and np.array_equal(
            alone_idx[0], idx[k, :, : used[k]]
        )


def test_device_crop_one_process_two_ranks_and_resume_see_the_same_pixels(margin_train):
    _same_across_ranks_and_resume(_device_batches, margin_train)


def test_trainer_crops_on_the_device_when_asked_and_never_features_or_offloaded(margin_train):
    from toolkit.core.config import build
    from toolkit.train.batches import TrainData, crop_on_device
    from toolkit.train.config import TrainConfig
    from toolkit.train.runtime import Runtime

    cfg = build(
        TrainConfig,
        {
            "data": str(margin_train),
            "out": "unused",
            "model": MODEL,
            "batch_size": 8,
            "steps": 2,
            "augment": {"crop_on": "device"},
        },
    )
    rt = Runtime(rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
    data = TrainData(cfg.data_plan(), rt, TrainDataset.open(str(margin_train)))
    assert data.image_transform == augment.DeviceCrop(SIZE, cfg.seed, cfg.augment)
    batch = next(data.batches(0))
    assert "crop_box" in batch and batch["image"].shape == (8, 36, 36, 3)  # the stored pixels travel
    image, _, index = data.to_device(batch)
    assert image.shape == (8, SIZE, SIZE, 3) and image.dtype == torch.uint8
    on_cpu = build(
        TrainConfig, {"data": str(margin_train), "out": "unused", "model": MODEL, "batch_size": 8, "steps": 2}
    )  # auto: the loader crops on a CPU device
    cropped = next(TrainData(on_cpu.data_plan(), rt, TrainDataset.open(str(margin_train))).batches(0))
    assert torch.equal(cropped["index"], index)
    assert (cropped["image"].int() - image.int()).abs().max() <= 2
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert crop_on_device("auto", cuda, False) and not crop_on_device("auto", cpu, False)
    assert not crop_on_device("device", cuda, True) and not crop_on_device("loader", cuda, False)
    assert augment.pixel_transform(AugmentConfig(), None, SIZE, 0, on_device=True) is None  # features
