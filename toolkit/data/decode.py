"""Decode a batch of encoded images to uint8 [n, 3, S, S], cropping and resizing after decoding.

:func:`decode_batch` is the loader's decoder for JPEG-holding training data and the function the GPU
check times on CUDA:

- CPU, JPEG: libjpeg-turbo through ``torchvision.io.decode_jpeg`` (backend ``torchvision``) or through
  Pillow with DCT-domain downscaling (``draft``, backend ``pil``). ``auto`` picks per image by
  :data:`DRAFT_FACTOR`: Pillow when the image is at least that many times the target side (its draft
  decode then skips most of the IDCT work), else torchvision. benchmarks/decode_backends.py measured
  both (benchmarks/data/results/decode_backends.md).
- CUDA: one batched nvJPEG call (``decode_jpeg(list_of_tensors, device="cuda")``), then crop and
  bicubic resize on the device; a batch nvJPEG refuses goes through the CPU path.
- PNG, WebP and the rest: Pillow (alpha on white, 16-bit grey scaled, as :mod:`toolkit.data.images`).

Crops are given as *draws*, not pixel boxes, because a box depends on the image's size, known only
after decoding: row i of ``crops`` [n, 4] is (area fraction, aspect ratio w/h, x in [0, 1), y in
[0, 1)); :func:`crop_box` (defined in :mod:`toolkit.data.images`, with the libjpeg-turbo path
``turbo_crop`` that decode_rgb shares) turns it into a pixel box for a W x H image. ``crops=None`` takes
the centred square (precompute's ``center_crop``). The resize is bicubic with antialiasing (Pillow's
filter), so the CPU result matches Pillow's ``resize(box=...)`` up to rounding.
"""

from __future__ import annotations

import io
import math
import warnings
from collections.abc import Sequence
from typing import Literal

import numpy as np

from toolkit.data.images import (
    DEFAULT_MAX_IMAGE_PIXELS,
    DRAFT_FACTOR,
    ImageError,
    _open,
    crop_box,
    is_jpeg,
    jpeg_header,
    to_rgb,
    turbo_crop,
)

Backend = Literal["auto", "torchvision", "pil"]
# auto: Pillow's draft decode at or above DRAFT_FACTOR x the target side, libjpeg-turbo below (images.py,
# where decode_rgb, the precompute and index-loader decoder, shares the rule and the decoder).
# torchvision 0.29 warns on every decode call that its codecs move to torchcodec (not installed here); the
# decoders still work and are what the loader measured fastest, so the per-call warning is noise.
warnings.filterwarnings(
    "ignore",
    message="The image decoding and encoding capabilities of TorchVision",
    category=DeprecationWarning,
)


def center_draws(n: int) -> np.ndarray:
    """Draws [n, 4] for the centred square crop (area fraction 1 of the square, ratio 1, centred)."""
    return np.tile(np.array([[1.0, 1.0, 0.5, 0.5]]), (n, 1))


def _pil_one(data: bytes, size: int, draw, max_pixels: int):
    """Pillow decode (draft for JPEG) -> crop -> bicubic resize; uint8 tensor [3, size, size]."""
    import torch
    from PIL import Image

    img = _open(data, max_pixels)
    full_w, full_h = img.size
    left, top, crop_w, crop_h = crop_box(full_w, full_h, draw)
    if img.format == "JPEG" and img.mode in ("RGB", "L"):
        scale = size / min(crop_w, crop_h)  # decode only as fine as the crop needs
        img.draft(img.mode, (math.ceil(full_w * scale), math.ceil(full_h * scale)))
    img.load()
    rgb, _ = to_rgb(img)
    sx, sy = rgb.width / full_w, rgb.height / full_h  # the draft scale (1 without one)
    box = (left * sx, top * sy, (left + crop_w) * sx, (top + crop_h) * sy)
    out = rgb.resize((size, size), Image.Resampling.BICUBIC, box=box)
    return torch.from_numpy(np.asarray(out, dtype=np.uint8).copy()).permute(2, 0, 1)


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a JPEG's SOF header (no decode), or None when not found."""
    header = jpeg_header(data)
    return None if header is None else header[:2]


def _cpu_one(data: bytes, size: int, draw, backend: Backend, max_pixels: int):
    if not is_jpeg(data) or backend == "pil":
        return _pil_one(data, size, draw, max_pixels)
    if backend == "auto":
        dims = _jpeg_size(data)
        if dims is None or min(dims) >= DRAFT_FACTOR * size:
            return _pil_one(data, size, draw, max_pixels)
    try:
        return turbo_crop(data, size, draw, max_pixels)
    except RuntimeError:  # a JPEG libjpeg-turbo's torchvision wrapper refuses (e.g. CMYK, 12-bit): Pillow
        return _pil_one(data, size, draw, max_pixels)


def _decode_cpu(encoded: Sequence[bytes], size: int, draws, backend: Backend, max_pixels: int):
    import torch

    out = torch.empty((len(encoded), 3, size, size), dtype=torch.uint8)
    for i, data in enumerate(encoded):
        try:
            out[i] = _cpu_one(data, size, None if draws is None else draws[i], backend, max_pixels)
        except ImageError as err:
            raise ImageError(err.reason, f"image {i} of the batch: {err}") from err
        except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError) as err:
            raise ImageError(
                "corrupt_image", f"image {i} of the batch: cannot decode: {type(err).__name__}: {err}"
            ) from err
    return out


def _decode_cuda(encoded: Sequence[bytes], size: int, draws, device, max_pixels: int):
    """nvJPEG for the batch's JPEGs in one call, crop + resize on the device; the rest through the CPU."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms.v2 import functional as F

    out = torch.empty((len(encoded), 3, size, size), dtype=torch.uint8, device=device)
    jpegs = [i for i, data in enumerate(encoded) if is_jpeg(data)]
    for i in jpegs:  # refuse a decompression bomb from its header, before nvJPEG allocates for it
        dims = _jpeg_size(encoded[i])
        if dims is not None and dims[0] * dims[1] > max_pixels:
            raise ImageError(
                "decompression_bomb",
                f"image {i} of the batch: {dims[0]}x{dims[1]} pixels exceeds the limit of {max_pixels}",
            )
    try:
        images = (
            decode_jpeg(
                [torch.frombuffer(bytearray(encoded[i]), dtype=torch.uint8) for i in jpegs],
                mode=ImageReadMode.RGB,
                device=device,
            )
            if jpegs
            else []
        )
    except RuntimeError:  # nvJPEG refused one of them: decode the whole batch on the CPU
        return _decode_cpu(encoded, size, draws, "auto", max_pixels).to(device)
    for i, chw in zip(jpegs, images, strict=True):
        height, width = chw.shape[-2:]
        left, top, crop_w, crop_h = crop_box(width, height, None if draws is None else draws[i])
        crop = chw[:, top : top + crop_h, left : left + crop_w].unsqueeze(0).float()
        resized = F.resize(crop, [size, size], interpolation=F.InterpolationMode.BICUBIC, antialias=True)
        out[i] = resized[0].round_().clamp_(0, 255).to(torch.uint8)
    done = set(jpegs)
    rest = [i for i in range(len(encoded)) if i not in done]
    if rest:
        sub = None if draws is None else draws[rest]
        out[rest] = _decode_cpu([encoded[i] for i in rest], size, sub, "pil", max_pixels).to(device)
    return out


def decode_batch(
    encoded: Sequence[bytes],
    size: int,
    crops: np.ndarray | None = None,
    device="cpu",
    backend: Backend = "auto",
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
):
    """Encoded images (JPEG, PNG, WebP, ...) -> uint8 tensor [n, 3, size, size] on ``device``.

    ``crops``: float array [n, 4] of draws (module docstring; :func:`crop_box`), or None for the centred
    square. ``device`` "cuda..." decodes JPEGs with nvJPEG in one batch; ``backend`` picks the CPU
    decoder. Raises :class:`ImageError` naming the batch position of an undecodable image. Called by
    loader workers (CPU) or the training process (CUDA).
    """
    import torch

    if crops is not None and len(crops) != len(encoded):
        raise ValueError(f"crops: {len(crops)} rows for {len(encoded)} images")
    device = torch.device(device)
    if device.type == "cuda":
        return _decode_cuda(encoded, size, crops, device, max_pixels)
    return _decode_cpu(encoded, size, crops, backend, max_pixels)


def decode_one_pil(data: bytes, size: int) -> np.ndarray:
    """Reference: Pillow's full decode + centred square + bicubic resize, HWC uint8 (tests, benchmarks)."""
    from PIL import Image

    rgb, _ = to_rgb(Image.open(io.BytesIO(data)))
    left, top, w, h = crop_box(rgb.width, rgb.height, None)
    out = rgb.resize((size, size), Image.Resampling.BICUBIC, box=(left, top, left + w, top + h))
    return np.asarray(out, dtype=np.uint8)
