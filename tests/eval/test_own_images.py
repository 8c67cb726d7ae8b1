"""Evaluation images in the modes a researcher's own photos come in (transparent PNG, palette with a
transparent entry, 16-bit PNG and TIFF) reach the model with the pixels training saw for the same file:
precompute composites alpha on white and scales 16 bits to 8 (toolkit.data.images); a bare PIL convert('RGB')
gave black or the hidden colour under transparency and pure white for 16-bit greys."""

from __future__ import annotations

import numpy as np
from PIL import Image

from toolkit.core.config import build
from toolkit.data.images import decode_rgb
from toolkit.eval.build import BuildSetConfig, run
from toolkit.eval.datasets import make_eval_loader, open_eval_set

SIDE = 8


def _images(folder) -> dict[str, tuple[int, int, int]]:
    """Writes one file per case into ``folder``; returns file name -> the RGB every pixel must have."""
    hidden_red = np.zeros((SIDE, SIDE, 4), np.uint8)
    hidden_red[..., 0] = 200  # fully transparent: training sees white, not this red
    Image.fromarray(hidden_red, "RGBA").save(folder / "a_rgba.png")
    palette = Image.new("P", (SIDE, SIDE), 0)
    palette.putpalette([0, 0, 0] + [0] * 765)
    palette.info["transparency"] = 0
    palette.save(folder / "b_palette.png", transparency=0)
    deep = np.full((SIDE, SIDE), 30000, np.uint16)
    Image.fromarray(deep).save(folder / "c_deep.png")
    Image.fromarray(deep).save(folder / "d_deep.tif")  # not png/jpg/webp: build-set re-encodes it
    grey = round(30000 * 255 / 65535)
    return {
        "a_rgba.png": (255, 255, 255),
        "b_palette.png": (255, 255, 255),
        "c_deep.png": (grey,) * 3,
        "d_deep.tif": (grey,) * 3,
    }


def test_eval_images_get_trainings_conversions(tmp_path):
    source = tmp_path / "photos" / "thing"
    source.mkdir(parents=True)
    expected = _images(source)
    for name, rgb in expected.items():  # the oracle agrees with precompute's decoder on every file
        pixels, _ = decode_rgb((source / name).read_bytes(), SIDE, "center_crop")
        assert (pixels == rgb).all(), name
    run(
        build(
            BuildSetConfig,
            {"source": "folder", "input": str(tmp_path / "photos"), "out": str(tmp_path / "sets" / "mine")},
        )
    )
    eval_set = open_eval_set(tmp_path / "sets", "mine")
    loader = make_eval_loader(eval_set, lambda img: np.asarray(img).copy(), batch_size=len(expected))
    images, _labels = next(iter(loader))
    assert images.shape == (len(expected), SIDE, SIDE, 3)
    for image, rgb in zip(
        images.numpy(), expected.values(), strict=True
    ):  # build-set keeps sorted file order
        assert (image == rgb).all(), (image[0, 0], rgb)
