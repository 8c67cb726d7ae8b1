"""A reference (teacher) model's embeddings, stored per sample by ``precompute --reference-model``.

DRRho-CLIP and distillation objectives read a frozen reference model's image and text embeddings of every
training pair. Precompute computes them once, beside the student's pixels or tokens, so training pays
nothing per step for them:

- the reference is ``--reference-model`` (an open_clip model name or config JSON, with ``--reference-weights``
  a local weights file; or a model folder, e.g. a cliptk run's ``model/``, with its own weights), loaded by
  :func:`toolkit.models.load_model`; a name without weights is refused (a random reference teaches nothing);
- each kept image is decoded from its raw bytes (the RGB conversion rules of :mod:`toolkit.data.images`) and
  goes through the reference's *own* inference transform (its size, resize mode, mean and std: open_clip's
  ``image_transform_v2`` of its preprocess config), never through the student's stored pixels;
- each caption goes through the reference's own tokenizer;
- the embeddings are L2-normalised in float32 and stored as float16 ``[d_ref]``: fields ``ref_image`` and
  ``ref_text`` of every sample (pixels: two more tar members; jpeg/index: two more columns of the table),
  covered by the same checksums as the other fields.

``dataset.json`` records the reference under ``extra.reference`` (model, weights file, its sha256, d_ref,
preprocessing, context length). Workers write a raw shard's rows to ``<stem>.ref`` in the scratch folder:
float16 [n, 2, d_ref] (image row, then text row).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from toolkit.data.trainset.format import REF_ROLES as ROLES
from toolkit.data.trainset.format import Field

SCRATCH_EXT = ".ref"  # a raw shard's reference rows in the scratch folder: float16 [n, 2, d_ref]


@dataclass
class Reference:
    """A loaded reference model: ``encode_images(list of raw image bytes) -> float16 [n, dim]`` and
    ``encode_texts(list of n captions) -> float16 [n, dim]``, both L2-normalised rows."""

    spec: str
    weights: str
    sha256: str
    dim: int
    preprocess_cfg: dict[str, Any]
    context_length: int
    model: Any
    preprocess: Callable[[Any], Any]
    tokenizer: Callable[[list[str]], Any]
    device: str = "cpu"

    def encode_images(self, images: list[bytes], max_pixels: int) -> np.ndarray:
        import torch

        from toolkit.data.images import open_rgb

        batch = torch.stack([self.preprocess(open_rgb(data, max_pixels)) for data in images])
        with torch.inference_mode():
            feats = self.model.encode_image(batch.to(self.device))
        return _normalised(feats)

    def encode_texts(self, captions: list[str]) -> np.ndarray:
        import torch

        with torch.inference_mode():
            feats = self.model.encode_text(self.tokenizer(list(captions)).to(self.device))
        return _normalised(feats)

    def identity(self) -> dict[str, Any]:
        """What makes two references' rows interchangeable (precompute's resume records it)."""
        return {"weights_sha256": self.sha256, "dim": self.dim}

    def info(self) -> dict[str, Any]:
        """What ``dataset.json``'s ``extra.reference`` records."""
        return {
            "model": self.spec,
            "weights": self.weights,
            "weights_sha256": self.sha256,
            "dim": self.dim,
            "preprocess": self.preprocess_cfg,
            "context_length": self.context_length,
        }


def _normalised(feats: Any) -> np.ndarray:
    import torch

    return torch.nn.functional.normalize(feats.float(), dim=-1).cpu().numpy().astype(np.float16)


def load_reference(spec: str, weights: str = "", device: str = "cpu") -> Reference:
    """The reference of ``spec`` (+ ``weights``), in eval mode on ``device``. ValueError for an unknown model,
    a name or config without a weights file; CheckpointError naming a missing weights file or folder.
    Called by every precompute rank before its worker pool forks (the workers share it copy-on-write).
    The weights are hashed once: load_model's checkpoint check hands over the digest it computed."""
    from toolkit.core.files import file_sha256
    from toolkit.models import load_model, resolve_spec

    resolved = resolve_spec(spec, weights or None)  # unknown names and missing files fail here, named
    if resolved.weights is None:
        raise ValueError(
            f"reference_model {spec!r}: needs reference_weights, a local weights file (a random "
            "initialisation is no reference); or give a model folder with its weights"
        )
    import torch

    loaded = load_model(spec, weights=weights or None, device=device)
    with torch.inference_mode():  # the width the model outputs, whatever its config calls it
        dim = int(loaded.model.encode_text(loaded.tokenizer(["a"]).to(device)).shape[-1])
    sha256 = loaded.weights_sha256 or file_sha256(resolved.weights)
    return Reference(
        spec,
        str(resolved.weights),
        sha256,
        dim,
        dict(loaded.preprocess_cfg),
        loaded.context_length,
        loaded.model.requires_grad_(False),
        loaded.preprocess,
        loaded.tokenizer,
        device,
    )


def fields(dim: int) -> list[Field]:
    """The two per-sample fields of a reference of width ``dim``."""
    return [Field.make(role, (dim,)) for role in ROLES]


def scratch_field(dim: int) -> Field:
    """One scratch row of a raw shard's ``<stem>.ref``: the image and the text embedding."""
    return Field("reference", "ref.f16", "float16", (2, dim))


class ReferenceSink:
    """A worker's reference rows of one raw shard: ``add`` each kept image's raw bytes in order (encoded
    ENCODE_BATCH at a time), then ``close(captions)`` encodes the captions and writes ``stem + '.ref'``."""

    def __init__(self, reference: Reference, stem: str, batch: int, max_pixels: int):
        self.reference, self.path, self.batch, self.max_pixels = (
            reference,
            stem + SCRATCH_EXT,
            batch,
            max_pixels,
        )
        self.pending: list[bytes] = []
        self.images: list[np.ndarray] = []
        self.seconds = (
            0.0  # spent on the reference (decode, transform, forward passes): its cost in the manifest
        )

    def add(self, data: bytes) -> None:
        self.pending.append(data)
        if len(self.pending) >= self.batch:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            start = time.perf_counter()
            self.images.append(self.reference.encode_images(self.pending, self.max_pixels))
            self.seconds += time.perf_counter() - start
            self.pending = []

    def close(self, captions: list[str]) -> None:
        self._flush()
        start, dim = time.perf_counter(), self.reference.dim
        images = np.concatenate(self.images) if self.images else np.zeros((0, dim), np.float16)
        texts = [
            self.reference.encode_texts(captions[s : s + self.batch])
            for s in range(0, len(captions), self.batch)
        ]
        texts_arr = np.concatenate(texts) if texts else np.zeros((0, dim), np.float16)
        self.seconds += time.perf_counter() - start
        if images.shape != texts_arr.shape:
            raise RuntimeError(
                f"{self.path}: {len(images)} reference image rows but {len(texts_arr)} captions"
            )
        with open(self.path, "wb") as fh:
            fh.write(np.ascontiguousarray(np.stack([images, texts_arr], axis=1), "<f2").tobytes())


def split_row(row: np.ndarray, dim: int) -> list[bytes]:
    """One scratch row (uint8 [4 * dim]) -> the ``ref_image`` and ``ref_text`` payloads."""
    return [row[: 2 * dim].tobytes(), row[2 * dim :].tobytes()]


def bytes_per_sample(ds: Any) -> int:
    """Bytes each sample spends on its reference embeddings (0 without one), as its storage mode lays them
    out: pixels' two tar members (headers and padding included), or the table's two columns in jpeg/index."""
    found = [ds.field(role) for role in ROLES]
    if not all(found):
        return 0
    from toolkit.data.trainset import storage

    mode = storage.of(ds)
    return sum(mode.field_bytes(f) for f in found)
