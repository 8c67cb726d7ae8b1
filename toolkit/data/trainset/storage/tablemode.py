"""What the table modes share (:mod:`.tables`: a table of byte ranges per part, read by ``RefReader``):
:class:`TableMode` (the precompute writer, reader, verify and inspect sides) and :class:`EncodedMode`
(images re-encoded at the stored size into a data file per part, as ``jpeg`` does; a mode with another
codec overrides :meth:`EncodedMode.encode` and names its suffixes)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import numpy as np
import xxhash

from toolkit.data.trainset import integrity
from toolkit.data.trainset.format import Field, TrainDataset, ref_dtype
from toolkit.data.trainset.segment import Segment
from toolkit.data.trainset.storage.base import MAX_OPEN_FILES, REF_ROW, ImageRows, StorageMode
from toolkit.data.trainset.storage.tables import (
    CHECKSUM_MISMATCH,
    RefReader,
    RefShardWriter,
    decode_image,
    iter_segment,
    resolve_data_root,
)


class TableMode(StorageMode):
    """A table record per sample: (file, length, offset, xxh3-64 of the image bytes, token ids, reference
    embeddings); the loader reads and checks the bytes, then decodes them (:func:`.tables.decode_image`)."""

    parts_noun = "tables"
    data_ext: ClassVar[str] = ""  # suffix of each part's own data file; "" when the data files lie elsewhere
    scratch_ext: ClassVar[str] = ""  # a worker's encoded images of one raw shard ('<stem>' + this), if any

    def scratch_image(self, image: Field) -> Field:
        return Field("image", "ref", "uint8", (REF_ROW.itemsize,))

    def write(self, job: Any, samples: Iterator, urls: list[str]) -> tuple[list, str, list[str]]:
        """The parts (RefShardWriter) from ``samples`` ((result, row, meta) in id order); returns (parts,
        data_root, data_files) for dataset.json (:meth:`data_location`)."""
        fields = job.fields
        ref_dim = fields[2].shape[0] if len(fields) > 2 else 0
        cfg = job.cfg
        writer = RefShardWriter(cfg.out, self.data_ext, fields[1].shape[0], cfg.samples_per_shard, ref_dim)
        current, data_fh = None, None
        try:
            for sample_id, (res, row, meta) in enumerate(samples):
                if res is not current:  # results arrive in order: one shard's scratch open at a time
                    current = res
                    if data_fh is not None:
                        data_fh.close()
                    data_fh = open(job.stem(res) + self.scratch_ext, "rb") if self.scratch_ext else None
                    rows = job.scratch_rows(res)
                    ref_rows, texts = rows[0].view(REF_ROW)[:, 0], rows[1].view("<i4")
                    embeddings = rows[2].view("<f2").reshape(-1, 2, ref_dim) if ref_dim else None
                offset, length, digest = (int(ref_rows[row][k]) for k in ("offset", "length", "hash"))
                data = None
                if data_fh is not None:
                    data_fh.seek(offset)
                    data = data_fh.read(length)
                writer.add(
                    sample_id,
                    res.index,
                    offset,
                    length,
                    digest,
                    texts[row],
                    meta,
                    data,
                    tuple(embeddings[row]) if ref_dim else (),
                )
        finally:
            if data_fh is not None:
                data_fh.close()
        return (writer.close(), *self.data_location(job.cfg.out, urls, writer.data_files))

    def data_location(self, out: str, urls: list[str], data_files: list[str]) -> tuple[str, list[str]]:
        """(data_root, data_files) of dataset.json: the parts' own data files beside the tables."""
        return ".", data_files

    def sample_bytes(self, ds: TrainDataset) -> int:
        return ds.table_dtype.itemsize  # also ds.sample_bytes: its data_files make it a table set

    def reader(self, ds: TrainDataset, vocab_size: int | None) -> RefReader:
        return RefReader(ds, vocab_size, MAX_OPEN_FILES)

    def read_segment(self, ds: TrainDataset, seg: Segment) -> Iterator[dict[str, Any]]:
        return iter_segment(ds, seg.shard, seg.start, seg.count, seg.valid)

    def verify_part(
        self, ds: TrainDataset, index: int, vocab: int | None, count: Any, notes: dict
    ) -> list[tuple[str, bool]]:
        """Its table against dataset.json, then every record's image bytes (length, xxh3-64, decodable) and
        token ids. ``notes["files"]``: per data file, [records checked, checksum mismatches]."""
        tally = notes.setdefault("files", {})
        reader = RefReader(ds, vocab)
        shard, found = ds.shards[index], []
        try:
            table = reader.table(index)
        except (OSError, ValueError) as err:
            count.advance(shard.num_samples)
            return [(str(err), False)]
        try:
            for position, rec in enumerate(table):
                seen = tally.setdefault(int(rec["file"]), [0, 0])
                seen[0] += 1
                try:
                    data = reader.image_bytes(index, position, rec)
                    decode_image(data, reader.side, reader.resize_mode)
                    integrity.check_tokens(ds, index, position, rec["tokens"][None], vocab)
                except integrity.DataIntegrityError as err:
                    seen[1] += CHECKSUM_MISMATCH in str(err)
                    found.append((str(err).split("; run `toolkit data verify")[0], True))
                except ValueError as err:  # ImageError: the bytes match the index but no longer decode
                    url = reader.data_url(int(rec["file"]))
                    found.append(
                        (
                            f"{url}: sample {position} of {shard.name} (id {shard.first_id + position}) "
                            f"does not decode: {err}",
                            True,
                        )
                    )
                count.advance(1)
        finally:
            reader.close()
        return found

    def verify_lines(self, ds: TrainDataset, notes: dict) -> list[str]:
        """One line when data files match none of the checksums recorded for their samples: they are other
        files than were indexed (an index copied beside another raw folder with the same file names read as
        every sample "damaged: checksum does not match", never saying why)."""
        files_ = notes.get("files", {})
        other = sorted(f for f, (checked, wrong) in files_.items() if checked and wrong == checked)
        if not other:
            return []
        names = ", ".join(ds.data_files[f] for f in other[:3])
        names += f" and {len(other) - 3} more" if len(other) > 3 else ""
        where = resolve_data_root(ds.root, ds.data_root)
        return [
            f"{where}: {len(other)} of the {len(ds.data_files)} data files ({names}) match none of the "
            "checksums recorded for their samples: they are not the files this set indexed (same names, "
            "other contents; was the set copied beside another raw folder?); point data_root in "
            f"{ds.root}/dataset.json at the indexed files or precompute again"
        ]

    def stored_files(self, ds: TrainDataset) -> list[str]:
        return list(ds.data_files) if self.data_ext else []

    def disk_bytes_per_sample(self, image_side: int, context_length: int) -> float:
        return ref_dtype(context_length).itemsize


class _EncodedRows(ImageRows):
    """Each kept image encoded (``encode``) and appended to ``<stem><scratch_ext>``; its row points there."""

    def __init__(self, mode: EncodedMode, job: Any, stem: str):
        self.mode, self.job = mode, job
        self.fh = open(stem + mode.scratch_ext, "wb")

    def row(self, sample: Any, ext: str, data: bytes, pixels: np.ndarray) -> bytes:
        encoded, offset = self.mode.encode(pixels, self.job), self.fh.tell()
        self.fh.write(encoded)
        return np.array([(offset, len(encoded), xxhash.xxh3_64_intdigest(encoded))], REF_ROW).tobytes()

    def close(self) -> None:
        self.fh.close()


class EncodedMode(TableMode):
    """Images re-encoded at the stored size (``encode``) into ``NNNNN.<data_ext>`` per part, beside the
    tables; decoded by the loader with :func:`toolkit.data.images.decode_rgb` (any format Pillow reads)."""

    # Encoded bytes per stored pixel for toolkit plan's disk figure (a mode measures its own).
    bytes_per_pixel: ClassVar[float] = 0.0

    def encode(self, pixels: np.ndarray, job: Any) -> bytes:
        """uint8 [S, S, 3] -> the encoded image (runs in precompute's workers)."""
        raise NotImplementedError

    def image_rows(self, job: Any, stem: str, url: str) -> ImageRows:
        return _EncodedRows(self, job, stem)

    @property
    def suffixes(self) -> tuple[str, ...]:  # type: ignore[override]
        return (".idx", "." + self.data_ext)

    def disk_bytes_per_sample(self, image_side: int, context_length: int) -> float:
        table = super().disk_bytes_per_sample(image_side, context_length)
        return table + self.bytes_per_pixel * image_side**2
