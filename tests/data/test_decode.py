"""toolkit.data.decode: batched decode + crop + resize, checked against Pillow on real encoded images."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from datakit import encode
from PIL import Image

from toolkit.data import decode
from toolkit.data.images import ImageError, decode_rgb


def photo(rng, width: int, height: int) -> Image.Image:
    """A smooth colour field plus grain (JPEG behaves on it as on a photo)."""
    low = rng.integers(0, 256, (4, 5, 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(low).resize((width, height), Image.Resampling.BICUBIC), np.int16)
    return Image.fromarray(np.clip(img + rng.integers(-10, 11, img.shape), 0, 255).astype(np.uint8))


def pil_reference(data: bytes, size: int, draw) -> np.ndarray:
    """Pillow full decode, crop_box's box, bicubic resize: HWC uint8."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    left, top, w, h = decode.crop_box(img.width, img.height, draw)
    return np.asarray(img.resize((size, size), Image.Resampling.BICUBIC, box=(left, top, left + w, top + h)))


def hwc(batch: torch.Tensor, i: int) -> np.ndarray:
    return batch[i].permute(1, 2, 0).numpy()


@pytest.mark.parametrize("dims", [(97, 64), (64, 97), (240, 180), (50, 50)])
def test_torchvision_decode_matches_pillow_centre_square(dims):
    rng = np.random.default_rng(sum(dims))
    data = [encode(photo(rng, *dims), "JPEG", quality=90) for _ in range(3)]
    out = decode.decode_batch(data, 32, backend="torchvision")
    assert out.shape == (3, 3, 32, 32) and out.dtype == torch.uint8
    for i, d in enumerate(data):
        diff = np.abs(hwc(out, i).astype(int) - pil_reference(d, 32, None))
        # the same libjpeg-turbo IDCT and Pillow's bicubic filter: only rounding differs
        assert diff.mean() < 0.5 and diff.max() <= 6, (diff.mean(), diff.max())


def test_crops_follow_the_draws():
    rng = np.random.default_rng(3)
    data = [encode(photo(rng, 120, 90), "JPEG", quality=95) for _ in range(4)]
    draws = np.array(
        [[0.9, 0.8, 0.0, 0.0], [1.0, 1.3, 0.99, 0.5], [0.95, 1.0, 0.3, 0.7], [0.9, 4 / 3, 0.5, 0.5]]
    )
    out = decode.decode_batch(data, 24, draws, backend="torchvision")
    for i, d in enumerate(data):
        diff = np.abs(hwc(out, i).astype(int) - pil_reference(d, 24, draws[i]))
        assert diff.mean() < 0.5 and diff.max() <= 6
    centre = decode.decode_batch(data, 24, backend="torchvision")
    assert not torch.equal(out[0], centre[0])  # a corner crop is not the centre square


def test_crop_box_stays_inside_and_keeps_area():
    rng = np.random.default_rng(0)
    for _ in range(500):
        w, h = (int(v) for v in rng.integers(1, 400, 2))
        draw = [
            rng.uniform(0.9, 1.0),
            np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3))),
            rng.random(),
            rng.random(),
        ]
        left, top, cw, ch = decode.crop_box(w, h, draw)
        assert 0 <= left and left + cw <= w and 0 <= top and top + ch <= h and cw >= 1 and ch >= 1
        if min(w, h) >= 50:  # rounding aside, the area fraction is the draw's
            assert cw * ch / (w * h) == pytest.approx(draw[0], abs=0.03)
    assert decode.crop_box(40, 30, None) == (5, 0, 30, 30)


def test_png_with_alpha_goes_through_pillow_like_precompute():
    rng = np.random.default_rng(5)
    rgba = np.concatenate(
        [np.asarray(photo(rng, 40, 30)), rng.integers(0, 256, (30, 40, 1), dtype=np.uint8)], 2
    )
    data = encode(Image.fromarray(rgba, "RGBA"), "PNG")
    webp = encode(photo(rng, 33, 41), "WEBP", lossless=True)
    out = decode.decode_batch([data, webp], 16)
    assert np.array_equal(hwc(out, 0), decode_rgb(data, 16)[0])  # alpha composited on white, same resize
    assert np.array_equal(hwc(out, 1), decode_rgb(webp, 16)[0])


def test_large_jpeg_takes_pillow_draft_and_stays_close():
    rng = np.random.default_rng(9)
    data = encode(photo(rng, 400, 300), "JPEG", quality=90)  # short side 300 >= 4 x 64: draft decode
    auto = hwc(decode.decode_batch([data], 64, backend="auto"), 0).astype(int)
    assert np.abs(auto - pil_reference(data, 64, None)).mean() < 3  # a DCT-scaled decode, not identical


def test_undecodable_image_names_its_position():
    rng = np.random.default_rng(1)
    good = encode(photo(rng, 20, 20), "JPEG")
    with pytest.raises(ImageError, match="image 1 of the batch") as err:
        decode.decode_batch([good, good[:40] + b"\0" * 10], 16, backend="pil")
    assert err.value.reason == "corrupt_image"
    with pytest.raises(ImageError, match="image 0 of the batch"):
        decode.decode_batch([b"not an image"], 16)
    for backend in ("torchvision", "pil"):  # 20 x 20 = 400 pixels over a limit of 399
        with pytest.raises(ImageError, match="399") as bomb:
            decode.decode_batch([good], 16, backend=backend, max_pixels=399)
        assert bomb.value.reason == "decompression_bomb"
    assert decode._jpeg_size(good) == (20, 20)
    with pytest.raises(ValueError, match="crops: 1 rows for 2 images"):
        decode.decode_batch([good, good], 16, np.zeros((1, 4)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_nvjpeg_batch_matches_cpu():
    rng = np.random.default_rng(2)
    data = [encode(photo(rng, 160 + 8 * i, 120), "JPEG", quality=90) for i in range(8)]
    data.append(encode(photo(rng, 50, 40), "PNG"))
    draws = np.array([[0.9 + 0.01 * i, 1.0, 0.5, 0.5] for i in range(9)])
    gpu = decode.decode_batch(data, 64, draws, device="cuda").cpu()
    cpu = decode.decode_batch(data, 64, draws, backend="torchvision")
    diff = (gpu.int() - cpu.int()).abs()
    assert diff.float().mean() < 1.5  # nvJPEG's IDCT and the float resize round differently


def test_decode_rgb_takes_libjpeg_turbo_for_small_jpegs_and_pillow_for_the_rest():
    """decode_rgb (precompute's and the index loader's decoder) is the loader's libjpeg-turbo decode for JPEGs
    under DRAFT_FACTOR x the target; grey JPEGs still count as converted from L; CMYK, big JPEGs and PNGs go
    through Pillow; a truncated JPEG is still refused with Pillow's reason."""
    from toolkit.data import images

    rng = np.random.default_rng(8)
    small = encode(photo(rng, 61, 47), "JPEG", quality=90)
    arr, converted = decode_rgb(small, 32)
    turbo = decode.decode_batch([small], 32, backend="torchvision")
    assert converted is None and np.array_equal(arr, hwc(turbo, 0))
    assert np.abs(arr.astype(int) - pil_reference(small, 32, None).astype(int)).mean() < 2  # same picture
    grey = encode(photo(rng, 40, 40).convert("L"), "JPEG", quality=90)
    g, converted = decode_rgb(grey, 16)
    assert converted == "L" and np.array_equal(g[..., 0], g[..., 2])
    cmyk = encode(photo(rng, 40, 36).convert("CMYK"), "JPEG", quality=90)
    assert images.jpeg_header(cmyk)[2] == 4 and decode_rgb(cmyk, 16)[1] == "CMYK"
    big = encode(photo(rng, 160, 130), "JPEG", quality=90)  # short side 130 >= 4 x 32: Pillow's draft
    assert images._turbo_square(big, 32, images.DEFAULT_MAX_IMAGE_PIXELS) is None
    assert decode_rgb(big, 32)[0].shape == (32, 32, 3)
    with pytest.raises(ImageError, match="truncated") as err:
        decode_rgb(small[: len(small) // 2], 32)
    assert err.value.reason == "corrupt_image"
