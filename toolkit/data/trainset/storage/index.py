"""Storage mode ``index``: no copy of the images. Each part's table points at the image member's bytes
inside the user's raw (uncompressed) webdataset tars, which the loader seeks into, checks and decodes
(:mod:`.tables`); <2 % extra disk, and the raw shards must stay where ``data_root`` says."""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash

from toolkit.core import files
from toolkit.data.raw.reader import split_common_dir
from toolkit.data.trainset.storage.base import REF_ROW, ImageRows
from toolkit.data.trainset.storage.tablemode import TableMode
from toolkit.data.trainset.storage.tables import relative_data_root


class _IndexRows(ImageRows):
    def __init__(self, url: str):
        self.url = url

    def row(self, sample: Any, ext: str, data: bytes, pixels: np.ndarray) -> bytes:
        offset, length = sample.offsets[ext]
        return np.array([(offset, length, xxhash.xxh3_64_intdigest(data))], REF_ROW).tobytes()

    def check(self, image_path: str) -> None:
        check_index_offsets(self.url, image_path)


class IndexMode(TableMode):
    """``--storage index``."""

    name = "index"
    suffixes = (".idx",)

    def image_rows(self, job: Any, stem: str, url: str) -> ImageRows:
        return _IndexRows(url)

    def data_location(self, out: str, urls: list[str], data_files: list[str]) -> tuple[str, list[str]]:
        """The raw shards, named relative to their common folder, itself stored relative to OUT when both are
        local (tables.relative_data_root)."""
        root, names = split_common_dir(urls)
        return relative_data_root(out, root), names


def check_index_offsets(url: str, image_path: str) -> None:
    """Read the first kept image back at its recorded offset in the raw tar; a compressed tar (offsets of the
    decompressed stream) fails here, naming the shard, instead of on every training read."""
    with open(image_path, "rb") as fh:
        offset, length, digest = (int(v) for v in np.frombuffer(fh.read(REF_ROW.itemsize), REF_ROW)[0])
    with files.open_ranges(url) as fh:
        try:
            fh.seek(offset)
            data = fh.read(length)
        except ValueError as err:  # fsspec's HTTP file: the server sent the whole file for a byte range
            raise ValueError(
                "storage index reads each image as a byte range, and this server does not "
                f"answer HTTP Range requests ({err}); serve the shards with one that does "
                "(toolkit data serve, any object store), or use storage pixels or jpeg"
            ) from err
        if xxhash.xxh3_64_intdigest(data) != digest:
            raise ValueError(
                f"{url}: storage index needs uncompressed tars (the image bytes are not at their "
                "tar offsets in the file); decompress the shards or use storage pixels or jpeg"
            )
