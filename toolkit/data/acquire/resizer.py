"""img2dataset's resizer with a strict Pillow check in front, used by ``fetch`` (in its worker) and ``shard``.

Rejected images get a message that :func:`toolkit.data.raw.reasons.classify` maps to a reason
('truncated_image', 'decompression_bomb', ...); images with 16 bits per sample become 8-bit PNGs first.
"""

from __future__ import annotations

import io
from typing import Any


def decode_image(data: bytes):
    """Fully decode ``data`` with Pillow: (image, None) or (None, an error message :func:`classify` maps).

    OpenCV (img2dataset's decoder) silently pads some truncated files; a full Pillow decode catches
    them, and Pillow's pixel-count limit rejects decompression bombs before OpenCV allocates them.
    """
    from PIL import Image, UnidentifiedImageError

    from toolkit.data.images import DEFAULT_MAX_IMAGE_PIXELS

    if not data:
        return None, "empty response: 0 bytes"
    try:
        img = Image.open(io.BytesIO(data))
        # Pillow itself only refuses 2x its limit (179 MP): a 100-150 MP image was decoded and stored, and
        # precompute then skipped it as a bomb. Hold fetch and shard to the limit precompute and eval apply.
        if img.width * img.height > DEFAULT_MAX_IMAGE_PIXELS:
            return None, (
                f"decompression bomb: {img.width}x{img.height} = {img.width * img.height:,} pixels "
                f"exceeds the limit of {DEFAULT_MAX_IMAGE_PIXELS:,}"
            )
        img.load()
    except UnidentifiedImageError:
        # no bytes quoted: a URL list can point at any file, and messages land in parquets and manifests
        return None, f"not an image: Pillow cannot identify the format of {len(data)} bytes"
    except Image.DecompressionBombError as err:
        return None, f"decompression bomb: {err}"
    except (OSError, SyntaxError, ValueError, EOFError) as err:
        if "truncated" in str(err).lower():
            return None, f"truncated image: {err}"
        return None, f"corrupt image: {type(err).__name__}: {err}"
    return img, None


def is_deep(img, data: bytes) -> bool:
    """True for images with more than 8 bits per sample, which OpenCV keeps at 16 bits."""
    from toolkit.data.images import DEEP_MODES

    if img.mode in DEEP_MODES:
        return True
    if img.format == "PNG":
        return data[24] == 16  # IHDR bit depth
    if img.format == "TIFF":
        bits = img.tag_v2.get(258, 8)  # BitsPerSample
        return max(bits if isinstance(bits, tuple) else (bits,)) > 8
    return False


def to_8bit_png(img) -> bytes:
    """Lossless 8-bit PNG of a deep image: grey gets precompute's levels (:func:`images.deep_to_l`);
    Pillow already gives RGB(A) 8 bits."""
    from toolkit.data.images import DEEP_MODES, deep_to_l

    if img.mode in DEEP_MODES:
        img = deep_to_l(img)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _deep_as_png(data: bytes) -> bytes | None:
    """Without the strict check: an 8-bit PNG of ``data`` if its header says deep, else None (also when
    Pillow cannot read it: img2dataset's own decoder then decides, as strict_decode=false asks)."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))  # reads the header only
        return to_8bit_png(img) if is_deep(img, data) else None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, Image.DecompressionBombError):
        return None


class CheckedResizer:
    """img2dataset's ``Resizer`` with Pillow in front: a full decode when ``strict``, a header read when not.

    When ``strict``, rejected images return :func:`decode_image`'s message. Either way, images with 16
    bits per sample are handed on as 8-bit PNGs: img2dataset's OpenCV path would cast 16-bit values to
    8 bits by saturation, turning nearly every pixel white. Same call signature and return tuple as
    ``img2dataset.resizer.Resizer.__call__``: (image bytes, width, height, original width, original
    height, error message). Picklable, so img2dataset's spawned download processes can use it.
    """

    def __init__(self, resizer: Any, strict: bool = True):
        self.resizer = resizer
        self.strict = strict

    def prepare(self, data: bytes) -> tuple[bytes | None, str | None]:
        """(bytes for img2dataset's resizer, None) or (None, error message); thread-safe."""
        if self.strict:
            img, error = decode_image(data)
            if error is not None:
                return None, error
            return (to_8bit_png(img) if is_deep(img, data) else data), None
        return _deep_as_png(data) or data, None

    def resize(self, data: bytes, blurring_bbox_list=None):
        """img2dataset's resizer on prepared bytes. NOT thread-safe: it dup2's fds 1 and 2 to /dev/null
        around each call, so concurrent calls can leave the process's stdout and stderr silenced."""
        return self.resizer(io.BytesIO(data), blurring_bbox_list)

    def __call__(self, img_stream, blurring_bbox_list=None):
        img_stream.seek(0)
        data, error = self.prepare(img_stream.read())
        img_stream.seek(0)  # the caller's stream (hashed and read for EXIF later) stays as it was
        if error is not None:
            return None, None, None, None, None, error
        return self.resize(data, blurring_bbox_list)
