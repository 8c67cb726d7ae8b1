"""The training shard format (``cliptk-train-v1``): fixed-size samples in plain webdataset tars.

A training directory holds ``dataset.json`` (this format's description, read by :meth:`TrainDataset.open`),
``NNNNN.tar`` shards and a ``NNNNN.meta.jsonl`` sidecar per shard (one line per sample: id,
caption, source shard and key). Each tar sample is keyed by its zero-padded global id
(``0000000042``) and holds one member per field, in a fixed order, as raw little-endian bytes:

======================  ==========  ============  ===============================
member                  dtype       shape         when
======================  ==========  ============  ===============================
``<id>.img.u8``         uint8       [H, W, 3]     pixels (RGB, not normalised)
``<id>.img_feat.f16``   float16     [D_img]       frozen image tower features
``<id>.tok.i32``        int32       [L]           token ids of the model's tokenizer
``<id>.txt_feat.f16``   float16     [D_txt]       frozen text tower features
``<id>.ref_img.f16``    float16     [D_ref]       reference model's image embedding
``<id>.ref_txt.f16``    float16     [D_ref]       reference model's text embedding
======================  ==========  ============  ===============================

Members are written in USTAR format with one 512-byte header each, so every sample occupies exactly
``sample_bytes`` = sum(512 + ceil(nbytes / 512) * 512) bytes and sample k of a shard starts at byte
``k * sample_bytes``: readers can seek straight to any sample. See docs/data-format.md.

This module holds the format: its fields and :class:`TrainDataset` (``dataset.json``);
:mod:`toolkit.data.trainset.segment` holds the seekable segment readers (``read_segment``,
``read_segment_webdataset``) that the loader and ``inspect`` use; ``writer.py`` holds
:class:`~toolkit.data.trainset.writer.TrainShardWriter`, which precompute writes with.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from toolkit.core import files
from toolkit.data.raw.layout import shard_stem
from toolkit.data.trainset import integrity

FORMAT = "cliptk-train-v1"
DATASET_JSON = "dataset.json"
KEY_DIGITS = 10
BLOCK = 512
# The storage mode of a dataset.json without a "storage" key (toolkit.data.trainset.storage: pixels).
DEFAULT_STORAGE = "pixels"
# Field roles (the loader's batch keys) -> tar member extension and dtype.
FIELD_EXTS = {
    "image": ("img.u8", "uint8"),
    "image_features": ("img_feat.f16", "float16"),
    "tokens": ("tok.i32", "int32"),
    "text_features": ("txt_feat.f16", "float16"),
    # a reference model's L2-normalised embeddings (precompute --reference-model; reference.py)
    "ref_image": ("ref_img.f16", "float16"),
    "ref_text": ("ref_txt.f16", "float16"),
}
REF_ROLES = ("ref_image", "ref_text")


@dataclass(frozen=True)
class Field:
    """One per-sample array: batch key ``role``, tar extension ``ext``, numpy ``dtype``, ``shape``."""

    role: str
    ext: str
    dtype: str
    shape: tuple[int, ...]

    @classmethod
    def make(cls, role: str, shape: tuple[int, ...]) -> Field:
        ext, dtype = FIELD_EXTS[role]
        return cls(role, ext, dtype, tuple(int(s) for s in shape))

    @property
    def nbytes(self) -> int:
        # math.prod, not np.prod: readers ask once per read call, and np.prod costs ~5 us a call
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def padded_bytes(self) -> int:
        return BLOCK + -(-self.nbytes // BLOCK) * BLOCK

    def decode(self, data: bytes) -> np.ndarray:
        """Member bytes -> array of this field's dtype and shape (a read-only view of ``data``)."""
        if len(data) != self.nbytes:
            raise ValueError(f"field {self.ext}: {len(data)} bytes, expected {self.nbytes}")
        return np.frombuffer(data, dtype=np.dtype(self.dtype).newbyteorder("<")).reshape(self.shape)


def ref_dtype(context_length: int, ref_dim: int = 0) -> np.dtype:
    """One sample's record in a jpeg/index table (:mod:`toolkit.data.trainset.storage.tables`), for captions
    of ``context_length`` tokens: where its encoded image lies, the image bytes' xxh3-64, its token ids, and
    with a reference model of width ``ref_dim`` its embeddings (float16, :mod:`.reference`)."""
    columns = [
        ("file", "<u4"),
        ("length", "<u4"),
        ("offset", "<u8"),
        ("hash", "<u8"),
        ("tokens", "<i4", (context_length,)),
    ]
    if ref_dim:
        columns += [("ref_image", "<f2", (ref_dim,)), ("ref_text", "<f2", (ref_dim,))]
    return np.dtype(columns)


@dataclass(frozen=True)
class ShardInfo:
    """One training shard: file name relative to the dataset root, sample count, first global id, and
    the hash of its per-sample checksums (empty for datasets precomputed before checksums)."""

    name: str
    num_samples: int
    first_id: int
    sums: str = ""  # xxh3-64 of the shard's checksum sidecar (integrity.py); "" in datasets written before


@dataclass
class TrainDataset:
    """The contents of ``dataset.json``; ``root`` is where it was read from (not stored)."""

    num_samples: int
    fields: list[Field]
    shards: list[ShardInfo]
    samples_per_shard: int
    source: str = ""
    model: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    format: str = FORMAT
    storage: str = (
        DEFAULT_STORAGE  # the storage mode's name (storage/: pixels, jpeg, index): how images are stored
    )
    data_root: str = ""  # jpeg/index: where data_files live (storage.tables.resolve_data_root)
    data_files: list[str] = field(default_factory=list)  # jpeg/index: the files the tables point into
    root: str = ""

    @property
    def sample_bytes(self) -> int:
        """Bytes per sample of the files readers seek in: a pixels shard's sample (its members with their
        headers and padding, the tar layout above), or one table record (:attr:`table_dtype`) in a set whose
        images lie in ``data_files`` (the table modes of toolkit.data.trainset.storage: jpeg, index)."""
        if self.data_files:
            return self.table_dtype.itemsize
        return sum(f.padded_bytes for f in self.fields)

    @property
    def table_dtype(self) -> np.dtype:
        """Table modes (jpeg, index): one record of the tables (:func:`ref_dtype`)."""
        ref = self.field("ref_image")
        return ref_dtype(self.field("tokens").shape[0], ref.shape[0] if ref is not None else 0)

    def field(self, role: str) -> Field | None:
        return next((f for f in self.fields if f.role == role), None)

    def url(self, shard: ShardInfo) -> str:
        return files.join(self.root, shard.name)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("root")
        if (self.storage, self.data_root, self.data_files) == (DEFAULT_STORAGE, "", []):
            for key in (
                "storage",
                "data_root",
                "data_files",
            ):  # pixels sets keep the dataset.json they always had
                data.pop(key)
        return data

    @classmethod
    def open(cls, root: str) -> TrainDataset:
        """Read ``root/dataset.json`` (local or fsspec); errors name the path."""
        path = files.join(root, DATASET_JSON)
        if not files.exists(path):
            raise FileNotFoundError(
                f"{path}: not found; is {root} a precompute output directory?{_raw_hint(root)}"
            )
        try:
            data = files.read_json(path)
        except (ValueError, UnicodeDecodeError) as err:  # empty, cut short, not JSON: name the file
            raise ValueError(
                f"{path}: not a valid dataset.json ({err}); precompute the folder again"
            ) from None
        if not isinstance(data, dict):
            raise ValueError(
                f"{path}: expected a JSON object, found {type(data).__name__}; precompute the folder again"
            )
        if data.get("format") != FORMAT:
            raise ValueError(f"{path}: format {data.get('format')!r}, this toolkit reads {FORMAT!r}")
        try:
            fields = [Field(f["role"], f["ext"], f["dtype"], tuple(f["shape"])) for f in data["fields"]]
            shards = [ShardInfo(**s) for s in data["shards"]]
            ds = cls(
                int(data["num_samples"]),
                fields,
                shards,
                int(data["samples_per_shard"]),
                data.get("source", ""),
                data.get("model", ""),
                data.get("extra", {}),
                data["format"],
                data.get("storage", DEFAULT_STORAGE),
                data.get("data_root", ""),
                list(data.get("data_files", [])),
                root=root,
            )
        except KeyError as err:
            raise ValueError(f"{path}: required key {err} is missing; precompute the folder again") from None
        except (TypeError, ValueError, AttributeError) as err:
            raise ValueError(
                f"{path}: a value has the wrong shape or type ({type(err).__name__}: {err}); "
                "precompute the folder again"
            ) from None
        if sum(s.num_samples for s in shards) != ds.num_samples:
            raise ValueError(f"{path}: shard sample counts do not add up to num_samples={ds.num_samples}")
        integrity.check_shard_entries(shards, path)
        check_reference_fields(ds, path)
        return ds


def _raw_hint(root: str) -> str:
    """The next step, when ``root`` has no dataset.json: a precompute that failed there (its manifest says
    why), or (local) .tar files: raw shards given to the trainer."""
    import os

    from toolkit.core.stage import read_manifest

    manifest = read_manifest(root)
    if (
        isinstance(manifest, dict)
        and manifest.get("kind") == "data.precompute"
        and manifest.get("status") != "done"
    ):
        return (
            f" Its precompute ended {manifest.get('status')!r}: {str(manifest.get('error'))[:300]}; fix that "
            "and run it again"
        )
    local = files.local_path(root) if files.is_local(root) else ""
    if not local or not os.path.isdir(local) or not any(n.endswith(".tar") for n in os.listdir(local)):
        return ""
    return (
        f" It holds .tar files: raw shards are read by `toolkit data precompute --in {root} --out TRAIN "
        "--model MODEL`, whose TRAIN folder is what `--data` takes"
    )


def check_reference_fields(ds: Any, path: str) -> None:
    """``dataset.json``'s reference fields agree with ``extra.reference`` (ValueError naming ``path``)."""
    found = [ds.field(role) for role in REF_ROLES]
    info = ds.extra.get("reference")
    if not any(found) and info is None:
        return
    if not all(found) or info is None:
        raise ValueError(
            f"{path}: reference fields {[r for r, f in zip(REF_ROLES, found, strict=True) if f]} and "
            f"extra.reference {'present' if info else 'missing'} do not go together; precompute again"
        )
    widths = {f.shape[0] for f in found}
    if widths != {int(info.get("dim", -1))}:
        raise ValueError(
            f"{path}: reference fields are {sorted(widths)}-d but extra.reference.dim says "
            f"{info.get('dim')}; precompute again"
        )


def id_key(sample_id: int) -> str:
    """Tar key of global sample id ``sample_id``: ``id_key(42) == '0000000042'``."""
    return f"{sample_id:0{KEY_DIGITS}d}"


# Training shards are numbered like raw shards (toolkit.data.raw.layout), so both sort the same way.
def shard_file(index: int) -> str:
    return f"{shard_stem(index)}.tar"


def meta_file(index: int) -> str:
    return f"{shard_stem(index)}.meta.jsonl"
