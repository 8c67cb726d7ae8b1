"""One precompute run's job: what every raw shard shares, decided and loaded once in the parent before its
workers fork (the config, the storage mode, the sample fields, the tokenizer, frozen towers and the reference
model), then handed to each worker and to each :func:`~.worker.process_shard` call. Per raw shard only a
:class:`~.worker.ShardTask` (index, URL, scratch stem) travels."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from toolkit.data.trainset.format import Field
from toolkit.data.trainset.precompute.resume import stem_of
from toolkit.data.trainset.precompute.worker import ShardResult, ShardTask


@dataclass
class Job:
    """A precompute run's shared state (module docstring); ``fields``: the stored sample fields (image or
    image_features, tokens or text_features, then ref_image and ref_text with a reference model)."""

    cfg: Any  # PrecomputeConfig
    mode: Any  # the storage mode (toolkit.data.trainset.storage)
    fields: list[Field]
    tokenizer: Any
    image_tower: Any = None
    text_tower: Any = None
    reference: Any = None  # reference.Reference (precompute --reference-model)
    pad_token: int = 0  # the tokenizer's padding id (the last position of an empty caption)

    @property
    def image_side(self) -> int:
        """Side of the stored images (0 when a frozen image tower stores features)."""
        return self.fields[0].shape[0] if self.fields[0].role == "image" else 0

    @property
    def on_device(self) -> bool:
        """True when a tower runs on a GPU: forked workers cannot use it, so this process encodes inline."""
        towers = (self.image_tower, self.text_tower, self.reference)
        return any(getattr(t, "device", "cpu") != "cpu" for t in towers)

    @property
    def scratch_fields(self) -> list[Field]:
        """The fixed-size rows of the workers' scratch files: the mode's image row and the text field, then
        with a reference model one row of both its embeddings (``<stem>.ref``, reference.scratch_field)."""
        from toolkit.data.trainset import reference

        tail = [reference.scratch_field(self.fields[2].shape[0])] if len(self.fields) > 2 else []
        return [self.mode.scratch_image(self.fields[0]), self.fields[1], *tail]

    def task(self, index: int, url: str, work: str) -> ShardTask:
        """Raw shard ``index`` (``url``), with its scratch files in the work folder ``work``."""
        from toolkit.data.trainset.precompute.resume import stem

        return ShardTask(index=index, url=url, stem=stem(work, url))

    def worker_start(self) -> None:
        """Runs first in each worker process: one intra-op thread per worker (the workers use every core)."""
        if self.image_tower is not None or self.text_tower is not None or self.reference is not None:
            import torch

            torch.set_num_threads(1)

    # ------------------------------------------------------------ the parent's side, for the storage mode
    def stem(self, res: ShardResult) -> str:
        return stem_of(res)

    def scratch_rows(self, res: ShardResult) -> list[np.ndarray]:
        """A processed raw shard's scratch files as uint8 rows [num_kept, nbytes] (``scratch_fields``)."""
        from toolkit.data.trainset.reference import SCRATCH_EXT

        paths = (res.image_path, res.text_path, stem_of(res) + SCRATCH_EXT)
        return [_rows(path, f, res.num_kept) for path, f in zip(paths, self.scratch_fields, strict=False)]

    def split_reference(self, row: np.ndarray) -> list[bytes]:
        """One reference scratch row -> the ``ref_image`` and ``ref_text`` payloads."""
        from toolkit.data.trainset.reference import split_row

        return split_row(row, self.fields[2].shape[0])

    def extra(self) -> dict:
        """Provenance the loader does not need but users and the trainer may: towers, resize mode."""
        cfg, extra = self.cfg, {"resize_mode": self.cfg.resize_mode, **self.mode.extra(self)}
        if self.image_tower is not None:
            t = self.image_tower
            extra["image_tower"] = {
                "kind": cfg.image_tower,
                "name": t.name,
                "dim": t.dim,
                "image_size": t.image_size,
                "mean": list(t.mean),
                "std": list(t.std),
                "weights": cfg.image_tower_weights,
            }
        else:  # image_size: the model's side; the stored side (the field's shape) adds the crop margin
            from toolkit.models.registry import image_size

            extra["image_size"] = cfg.image_size or image_size(cfg.model)
            extra["crop_scale_min"] = cfg.crop_scale_min
        if self.text_tower is not None:
            t = self.text_tower
            extra["text_tower"] = {
                "kind": cfg.text_tower,
                "name": t.name,
                "dim": t.dim,
                "context_length": t.context_length,
                "weights": cfg.text_tower_weights,
            }
        else:
            from toolkit.data.trainset import integrity

            extra["context_length"] = self.fields[1].shape[0]
            # the loader's token-id bound
            extra["vocab_size"] = integrity.tokenizer_vocab_size(self.tokenizer)
        if self.reference is not None:
            extra["reference"] = self.reference.info()
        return extra


def prepare(cfg: Any) -> Job:
    """Decide the storage mode, load the tokenizer, towers and reference (on this rank's GPU if any), and
    derive the sample fields: called once per process, before its workers fork."""
    from toolkit.data.images import stored_side
    from toolkit.data.trainset import reference, storage
    from toolkit.data.trainset.precompute.dist import tower_device
    from toolkit.models import frozen
    from toolkit.models.registry import image_size, tokenizer

    ref = (
        reference.load_reference(cfg.reference_model, cfg.reference_weights, tower_device())
        if cfg.reference_model
        else None
    )
    image_tower = (
        frozen.load_image_tower(cfg.image_tower, cfg.image_tower_model, cfg.image_tower_weights)
        if cfg.image_tower != "none"
        else None
    )
    if cfg.image_tower_size:
        image_tower.image_size = cfg.image_tower_size
    text_tower = (
        frozen.load_text_tower(cfg.text_tower, cfg.text_tower_model, cfg.text_tower_weights)
        if cfg.text_tower != "none"
        else None
    )
    tok = tokenizer(cfg.model)
    towers = [t for t in (image_tower, text_tower) if t is not None]
    device = tower_device() if towers else "cpu"
    for tower in towers if device != "cpu" else ():
        frozen.place_tower(tower, device)
    if image_tower is not None:
        image = Field.make("image_features", (image_tower.dim,))
    else:
        side = stored_side(cfg.image_size or image_size(cfg.model), cfg.crop_scale_min)
        image = Field.make("image", (side, side, 3))
    if text_tower is not None:
        text = Field.make("text_features", (text_tower.dim,))
    else:
        text = Field.make("tokens", (int(tok(["a"]).shape[1]),))
    fields = [image, text, *(reference.fields(ref.dim) if ref is not None else [])]
    # an empty caption's last position is padding (L >= 3 for every model): worker.count_cut compares with it
    pad = int(tok([""])[0, -1]) if text_tower is None else 0
    return Job(cfg, storage.get(cfg.storage), fields, tok, image_tower, text_tower, ref, pad)


def _rows(path: str, field: Field, count: int) -> np.ndarray:
    """Scratch file of ``count`` fixed-size rows -> uint8 memmap [count, field.nbytes]."""
    if count == 0:
        return np.zeros((0, field.nbytes), np.uint8)
    size = os.path.getsize(path)
    if size != count * field.nbytes:
        raise RuntimeError(f"{path}: {size} bytes, expected {count} rows of {field.nbytes}")
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(count, field.nbytes))
