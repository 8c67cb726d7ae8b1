"""Storage mode ``jpeg``: each image re-encoded as JPEG at the stored size (``--jpeg-quality``) into
``NNNNN.jpgs`` beside each part's table (:mod:`.tablemode`); decoded by the loader, ~1/10 of pixels' disk."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from toolkit.data.trainset.storage.tablemode import EncodedMode


class JpegMode(EncodedMode):
    """``--storage jpeg``."""

    name = "jpeg"
    data_ext = "jpgs"
    scratch_ext = ".jpg"
    # benchmarks/data/results/data_scale.md: real photos stored at 249 px, q90: 15,637 B a sample, 256 B of it
    # table and meta line, over 249^2 pixels
    bytes_per_pixel = 0.248

    def encode(self, pixels: np.ndarray, job: Any) -> bytes:
        from PIL import Image

        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, "JPEG", quality=job.cfg.jpeg_quality)  # PIL's 4:2:0 chroma
        return buf.getvalue()

    def extra(self, job: Any) -> dict:
        return {"jpeg_quality": job.cfg.jpeg_quality}
