"""Decode encoded image bytes into RGB uint8 arrays at a fixed square resolution.

One function, :func:`decode_rgb`, is shared by precompute, the jpeg/index loader
(``trainset.storage.tables``), inspect and the decode-on-the-fly benchmark baseline so that all of them
produce the same pixels (an index set reads exactly what a pixels set stores). A JPEG of 1 or 3 components
(grey, YCbCr) whose short side is under :data:`DRAFT_FACTOR` x the target is decoded by libjpeg-turbo through
torchvision and resized by torch's antialiased bicubic (the decoder of ``toolkit.data.decode``, ~2x Pillow at
256-512 px sources); other images, larger JPEGs (Pillow's reduced-DCT ``draft`` decode is faster there) and
every JPEG libjpeg-turbo refuses go through Pillow, which then words the refusal. Images in other modes are
converted, not skipped, and the conversion is reported (source mode) so the stage can count it:

- alpha (RGBA, LA, PA, palette or RGB with a transparency entry) is composited on white;
- 16-bit greyscale (I;16*, and I from PNG) is scaled 0..65535 -> 0..255, not clipped;
- CMYK, YCbCr, L, 1 and P go through PIL's converters.

Undecodable bytes raise :class:`ImageError` with a reason: ``corrupt_image`` (unidentifiable,
truncated or damaged data), ``decompression_bomb`` (more pixels than the limit, checked from the
header before any pixel is decoded) or ``unsupported_mode``.
"""

from __future__ import annotations

import io
import math
import re
import warnings
from collections.abc import Sequence
from typing import Literal

import numpy as np
from PIL import Image, UnidentifiedImageError

# File extensions (lower case, no dot) read as images: raw shard members, `toolkit data shard`'s folder
# sources and eval-set inputs. All of them are formats Pillow decodes.
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")
# PIL's own default limit (about 89.5 MP); a larger image is treated as a decompression bomb.
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
ResizeMode = Literal["center_crop", "pad"]
# A JPEG whose short side is >= DRAFT_FACTOR x the target side is decoded by Pillow at a reduced DCT scale
# (1/4 or 1/8); below that a full libjpeg-turbo decode through torchvision is as fast or faster (measured one
# thread: 2.1x Pillow at 256 px sources, 2.1x at 512, even at 1024; Pillow's draft 1.3x faster at 2048 px,
# where it decodes 1/16 of the pixels; benchmarks/data/results/decode_backends.md).
DRAFT_FACTOR = 4.0
_JPEG_MAGIC = b"\xff\xd8\xff"
WHITE = (255, 255, 255)
_ALPHA_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}
# Pillow modes with more than 8 bits per sample (16-bit grey PNG/TIFF open as I;16*, 32-bit as I, float as F).
DEEP_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")


class ImageError(ValueError):
    """An image that cannot be used; ``reason`` is the manifest's skip reason."""

    def __init__(self, reason: str, message: str):
        self.reason = reason
        super().__init__(message)


def _has_alpha(img: Image.Image) -> bool:
    return img.mode in _ALPHA_MODES or (img.mode in ("P", "RGB", "L") and "transparency" in img.info)


def deep_to_l(img: Image.Image) -> Image.Image:
    """A greyscale image in one of DEEP_MODES -> 8-bit L. A 16-bit range (I;16*, and I from PNG) is
    scaled 0..65535 -> 0..255, not clipped; 32-bit integers of unknown range and floats clip like PIL.

    Shared with :mod:`toolkit.data.acquire.resizer` (fetch and shard) so a deep image gets the same levels
    there."""
    arr = np.asarray(img)
    if img.mode == "F" or (img.mode == "I" and img.format != "PNG"):
        return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "L")
    arr = np.clip(arr.astype(np.int64), 0, 65535)
    return Image.fromarray(((arr * 255 + 32767) // 65535).astype(np.uint8), "L")


def to_rgb(img: Image.Image) -> tuple[Image.Image, str | None]:
    """Return (RGB image, source mode if a conversion happened else None)."""
    mode = img.mode
    if mode == "RGB" and "transparency" not in img.info:
        return img, None
    if _has_alpha(img):
        rgba = img.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, WHITE + (255,))
        canvas.alpha_composite(rgba)
        return canvas.convert("RGB"), f"{mode}+alpha" if mode in ("P", "RGB", "L") else mode
    if mode in DEEP_MODES:
        return deep_to_l(img).convert("RGB"), mode
    try:
        return img.convert("RGB"), mode
    except (ValueError, OSError) as err:
        raise ImageError("unsupported_mode", f"cannot convert mode {mode} to RGB: {err}") from err


def _crop_box(width: int, height: int) -> tuple[float, float, float, float]:
    """Centred square of side min(width, height), in source pixel coordinates."""
    side = min(width, height)
    left, top = (width - side) / 2, (height - side) / 2
    return left, top, left + side, top + side


def resize_square(img: Image.Image, size: int, mode: ResizeMode = "center_crop") -> Image.Image:
    """RGB image -> size x size: ``center_crop`` fills the square; ``pad`` fits it and pads white."""
    if mode == "center_crop":
        box = _crop_box(*img.size)
        if img.size == (size, size):
            return img
        return img.resize((size, size), Image.Resampling.BICUBIC, box=box)
    scale = size / max(img.size)
    new = (max(1, round(img.width * scale)), max(1, round(img.height * scale)))
    inner = img if img.size == new else img.resize(new, Image.Resampling.BICUBIC)
    canvas = Image.new("RGB", (size, size), WHITE)
    canvas.paste(inner, ((size - new[0]) // 2, (size - new[1]) // 2))
    return canvas


def _open(data: bytes, max_pixels: int) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # we check the size ourselves
            img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as err:
        raise ImageError("decompression_bomb", str(err)) from err
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        # Pillow's message names the BytesIO's memory address; without it skipped.jsonl is the same on every
        # run
        message = re.sub(r" <_io\.BytesIO object at 0x[0-9a-f]+>", "", str(err))
        raise ImageError("corrupt_image", f"cannot identify image: {message}") from err
    width, height = img.size
    if width * height > max_pixels:
        raise ImageError(
            "decompression_bomb",
            f"{width}x{height} = {width * height} pixels exceeds the limit "
            f"of {max_pixels} (max_image_pixels)",
        )
    if width < 1 or height < 1:
        raise ImageError("corrupt_image", f"empty image {width}x{height}")
    return img


def open_rgb(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """Encoded image bytes -> the whole RGB image at full resolution (the conversions of :func:`to_rgb`), for
    a model with its own transform (precompute's reference model). Raises :class:`ImageError`."""
    img = _open(data, max_pixels)
    try:
        img.load()
        return to_rgb(img)[0]
    except ImageError:
        raise
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, MemoryError) as err:
        raise ImageError("corrupt_image", f"cannot decode image: {type(err).__name__}: {err}") from err


def is_jpeg(data: bytes) -> bool:
    """Whether ``data`` starts like a JPEG (SOI marker and the next marker's 0xFF)."""
    return data[:3] == _JPEG_MAGIC


def jpeg_header(data: bytes) -> tuple[int, int, int] | None:
    """(width, height, number of colour components) from a JPEG's SOF header (no decode), or None."""
    if not is_jpeg(data):
        return None
    pos = 2
    while pos + 9 < len(data):
        if data[pos] != 0xFF:
            return None
        marker, length = data[pos + 1], int.from_bytes(data[pos + 2 : pos + 4], "big")
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            return (
                int.from_bytes(data[pos + 7 : pos + 9], "big"),
                int.from_bytes(data[pos + 5 : pos + 7], "big"),
                data[pos + 9],
            )
        pos += 2 + length
    return None


def turbo_decode(data: bytes):
    """JPEG bytes -> uint8 tensor [3, h, w] (RGB) by libjpeg-turbo (``torchvision.io.decode_jpeg``); raises
    RuntimeError for what it refuses (truncated, damaged, 12-bit, some CMYK)."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    with warnings.catch_warnings():  # torchvision 0.29 warns on every call that its codecs move to torchcodec
        warnings.simplefilter("ignore", DeprecationWarning)
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)


def resize_uint8(chw, size: int):
    """uint8 [3, h, w] (CPU) -> uint8 [3, size, size], bicubic with antialias (Pillow's filter)."""
    from torchvision.transforms.v2 import functional as F

    if chw.shape[-2:] == (size, size):
        return chw
    return F.resize(chw, [size, size], interpolation=F.InterpolationMode.BICUBIC, antialias=True)


def stored_side(image_size: int, crop_scale_min: float) -> int:
    """Side precompute stores for model side ``image_size``: every crop of area >= crop_scale_min of a
    square has both sides >= crop_scale_min x its side (crop_box keeps the ratio where the crop fits), so
    this side never upsamples a crop. 224 -> 249 at 0.9 (1.24x the bytes); 1.0 -> image_size."""
    return math.ceil(image_size / crop_scale_min - 1e-9)


def crop_box(width: int, height: int, draw: Sequence[float] | None) -> tuple[int, int, int, int]:
    """(left, top, crop_width, crop_height) in pixels of a ``width`` x ``height`` image for one draw.

    ``None``: the centred square of side min(width, height). Otherwise the crop has area
    ``draw[0] * width * height`` and aspect ratio ``draw[1]``, as torchvision's RandomResizedCrop; a ratio
    that would not fit inside the image is clamped into the range that fits (torchvision instead redraws up
    to 10 times, then falls back to a centre crop). ``draw[2:4]`` place the crop uniformly over the free room.
    """
    if draw is None:
        side = min(width, height)
        return (width - side) // 2, (height - side) // 2, side, side
    area = float(draw[0]) * width * height
    lo, hi = area / (height * height), (width * width) / area  # ratios whose crop fits in the image
    ratio = min(max(float(draw[1]), lo), hi)
    crop_w = min(width, max(1, round(math.sqrt(area * ratio))))
    crop_h = min(height, max(1, round(math.sqrt(area / ratio))))
    left = min(width - crop_w, int(float(draw[2]) * (width - crop_w + 1)))
    top = min(height - crop_h, int(float(draw[3]) * (height - crop_h + 1)))
    return left, top, crop_w, crop_h


def turbo_crop(data: bytes, size: int, draw: Sequence[float] | None, max_pixels: int):
    """JPEG bytes -> uint8 tensor [3, size, size]: libjpeg-turbo decode (:func:`turbo_decode`), the crop of
    ``draw`` (:func:`crop_box`; None: the centred square), bicubic antialiased resize. The one libjpeg-turbo
    path of :func:`decode_rgb` and ``toolkit.data.decode.decode_batch``. Raises RuntimeError for what
    libjpeg-turbo refuses (callers fall back to Pillow) and :class:`ImageError` for a decompression bomb."""
    chw = turbo_decode(data)
    height, width = chw.shape[-2:]
    if width * height > max_pixels:
        raise ImageError(
            "decompression_bomb",
            f"{width}x{height} = {width * height} pixels exceeds the limit of {max_pixels}",
        )
    left, top, crop_w, crop_h = crop_box(width, height, draw)
    return resize_uint8(chw[:, top : top + crop_h, left : left + crop_w], size)


def _turbo_square(data: bytes, size: int, max_pixels: int) -> tuple[np.ndarray, str | None] | None:
    """decode_rgb's libjpeg-turbo path (module docstring), or None where Pillow takes the image."""
    header = jpeg_header(data)
    if header is None or header[2] not in (1, 3) or min(header[:2]) >= DRAFT_FACTOR * size:
        return None
    if header[0] * header[1] > max_pixels or min(header[:2]) < 1:
        return None  # Pillow refuses it, with its reason
    try:
        square = turbo_crop(data, size, None, max_pixels)
    except RuntimeError:
        return None
    return np.ascontiguousarray(square.permute(1, 2, 0).numpy()), "L" if header[2] == 1 else None


def decode_rgb(
    data: bytes, size: int, mode: ResizeMode = "center_crop", max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
) -> tuple[np.ndarray, str | None]:
    """Encoded image bytes -> (uint8 array [size, size, 3], converted-from mode or None).

    Small and mid-sized JPEGs go through libjpeg-turbo (module docstring); Pillow decodes larger JPEGs at
    the smallest DCT scale that still covers the target (``draft``), which is where most of the speed of
    a resize-on-decode comes from. Raises :class:`ImageError`.
    """
    if mode == "center_crop":
        fast = _turbo_square(data, size, max_pixels)
        if fast is not None:
            return fast
    img = _open(data, max_pixels)
    if img.format == "JPEG" and img.mode in ("RGB", "L"):
        scale = size / (min(img.size) if mode == "center_crop" else max(img.size))
        img.draft(img.mode, (math.ceil(img.width * scale), math.ceil(img.height * scale)))
    try:
        img.load()
        rgb, converted = to_rgb(img)
        out = resize_square(rgb, size, mode)
        arr = np.asarray(out, dtype=np.uint8)
    except ImageError:
        raise
    except Image.DecompressionBombError as err:
        raise ImageError("decompression_bomb", str(err)) from err
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, MemoryError) as err:
        # PIL reports truncated and damaged data with any of these, depending on the codec.
        raise ImageError("corrupt_image", f"cannot decode image: {type(err).__name__}: {err}") from err
    if arr.shape != (size, size, 3):
        raise ImageError("corrupt_image", f"decoded to shape {arr.shape}, expected {(size, size, 3)}")
    return np.ascontiguousarray(arr), converted
