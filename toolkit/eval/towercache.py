"""Frozen-tower evaluation: the trunks' features of an eval set are computed once and cached; later
evaluations of any model with the same trunks on the same set run only the heads.

A frozen-tower (LiT) model is an open_clip model whose image tower is a timm trunk + head
(``visual.trunk``, ``visual.head``) and whose text tower is a Hugging Face encoder + projection
(``text.transformer``, ``text.pooler``, ``text.proj``): :func:`split_frozen` finds the parts. Only the heads
differ between checkpoints of a LiT run, so the trunk features are what is worth keeping:

- images: trunk features float32 ``[D_image]`` per image, keyed by the SHA-1 of the image's encoded bytes, in
  ``CACHE/<tower fingerprint>/images.npz``. A set is a hit when every one of its images is there: its tars
  are read and hashed (no image decoded) and the stored features are fed to the heads. Sets that share
  images share features (the demo's OpenMoji retrieval and groups sets are the same drawings), and a
  changed, added or removed image changes the set's fingerprint (its list of digests) by itself.
- texts: pooled trunk features ``[D_text]`` per distinct string (captions, class prompts), in
  ``CACHE/<tower fingerprint>/texts.npz``; strings not there yet are encoded and added.

The tower's fingerprint (:func:`tower_fingerprint`) is a SHA-256 of the trunks' weights (names, shapes,
dtypes, bytes), their classes and the image preprocessing (size, mean, std, interpolation, resize mode), so
another checkpoint with retrained trunks, or another resolution, misses. Cache files are written atomically
(temp + rename); an unreadable one is ignored and rewritten, with a warning naming it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from toolkit.core.log import get_logger
from toolkit.eval.datasets import EvalSet

# Bumped when the stored layout or the features' meaning changes: older caches then simply miss.
CACHE_VERSION = 2  # 2: eval images decoded with training's conversions (alpha on white, 16-bit grey scaled)
# Captions per text-trunk forward pass (MiniLM; each batch is cut to its longest caption).
TEXT_BATCH = 256


@dataclass
class FrozenSplit:
    """The parts of a frozen-tower CLIP model: trunks (expensive, cached) and heads (cheap, per model)."""

    model: Any
    tokenizer: Any  # list[str] -> LongTensor [n, L], right-padded with pad_id
    pad_id: int
    fast_trunk: Any = None  # a BatchNorm-folded, channels-last copy of the image trunk (cold passes)

    @property
    def image_trunk(self) -> Any:
        return self.fast_trunk if self.fast_trunk is not None else self.model.visual.trunk

    def image_head(self, feats: Any) -> Any:
        """[n, D_image] trunk features -> [n, embed_dim] (not normalised)."""
        return self.model.visual.head(feats)

    def text_trunk(self, tokens: Any) -> Any:
        """[n, L] token ids -> [n, D_text] pooled features, as HFTextEncoder.forward before its projection."""
        from toolkit.models.inference import trimmed_tokens

        text = self.model.text
        tokens = trimmed_tokens(tokens, self.pad_id)
        mask = (tokens != self.pad_id).long()
        return text.pooler(text.transformer(input_ids=tokens, attention_mask=mask), mask)

    def text_head(self, feats: Any) -> Any:
        return self.model.text.proj(feats)


def split_frozen(model: Any, tokenizer: Any) -> FrozenSplit | None:
    """The model's frozen-tower parts, or None for a model without a timm trunk + HF text encoder."""
    visual, text = getattr(model, "visual", None), getattr(model, "text", None)
    if not all(hasattr(visual, a) for a in ("trunk", "head")):
        return None
    if not all(hasattr(text, a) for a in ("transformer", "pooler", "proj", "config")):
        return None
    if getattr(text, "output_tokens", False) or text.config.pad_token_id is None:
        return None
    return FrozenSplit(model, tokenizer, int(text.config.pad_token_id))


def open_frozen(
    model: Any, tokenizer: Any, preprocess_cfg: dict[str, Any], feature_cache: str, copy_trunk: bool
) -> tuple[FrozenEval, str, str | None] | None:
    """(FrozenEval, tower fingerprint, cache folder or None) for a frozen-tower ``model`` on the CPU, else
    None. ``feature_cache``: a folder, 'auto' (:func:`default_cache_dir`) or 'off'. ``copy_trunk``: run cold
    passes on a folded copy of the image trunk and leave ``model`` untouched (a model still training);
    otherwise the caller folds the model itself (:func:`toolkit.models.inference.optimize_clip`)."""
    import copy

    from toolkit.models.inference import is_conv_trunk, prepare_image_trunk

    split = split_frozen(model, tokenizer)
    if split is None:
        return None
    fingerprint = tower_fingerprint(split, preprocess_cfg)  # before any folding: it changes the weights
    if copy_trunk and is_conv_trunk(split.model.visual.trunk):
        split.fast_trunk = prepare_image_trunk(copy.deepcopy(split.model.visual.trunk))
    root = (
        None if feature_cache == "off" else default_cache_dir() if feature_cache == "auto" else feature_cache
    )
    return FrozenEval.open(split, None if root is None else Path(root), fingerprint), fingerprint, root


def _hash_module(h: Any, module: Any) -> None:
    h.update(type(module).__qualname__.encode())
    for name, tensor in module.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())


def tower_fingerprint(split: FrozenSplit, preprocess_cfg: dict[str, Any]) -> str:
    """SHA-256 (first 24 hex digits) of both trunks' weights and the image preprocessing. Call it before
    :func:`toolkit.models.inference.optimize_clip` folds the BatchNorms (the weights it sees change)."""
    h = hashlib.sha256(f"cliptk-tower-features-v{CACHE_VERSION}".encode())
    _hash_module(h, split.image_trunk)
    _hash_module(h, split.model.text.transformer)
    h.update(type(split.model.text.pooler).__qualname__.encode())
    keys = ("size", "mean", "std", "interpolation", "resize_mode", "fill_color")
    h.update(json.dumps({k: preprocess_cfg.get(k) for k in keys}, sort_keys=True, default=str).encode())
    return h.hexdigest()[:24]


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/cliptk/tower-features`` (``~/.cache/...`` when XDG_CACHE_HOME is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cliptk", "tower-features")


def _save_npz(path: Path, **arrays: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
    os.replace(tmp, path)


def _load_npz(path: Path, keys: tuple[str, ...]) -> dict[str, np.ndarray] | None:
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in keys}
    except (OSError, ValueError, KeyError) as err:
        get_logger("eval").warning("%s: unreadable feature cache (%s); it is recomputed", path, err)
        return None


@dataclass
class TextTable:
    """Distinct strings -> pooled text-trunk features; ``tokenizer(list[str])`` returns row ids [n] that
    :meth:`encode` turns into head outputs, so clip-benchmark can drive it like a real tokenizer."""

    split: FrozenSplit
    path: Path | None
    rows: dict[str, int] = field(default_factory=dict)
    feats: list[np.ndarray] = field(default_factory=list)
    num_loaded: int = 0

    @classmethod
    def open(cls, split: FrozenSplit, path: Path | None) -> TextTable:
        table = cls(split, path)
        data = _load_npz(path, ("texts", "features")) if path else None
        if data is not None and len(data["texts"]) == len(data["features"]):
            table.rows = {str(t): i for i, t in enumerate(data["texts"])}
            table.feats = list(data["features"].astype(np.float32))
            table.num_loaded = len(table.feats)
        return table

    def tokenizer(self, texts: list[str]) -> Any:
        import torch

        missing = list(dict.fromkeys(t for t in texts if t not in self.rows))
        for start in range(0, len(missing), TEXT_BATCH):
            chunk = missing[start : start + TEXT_BATCH]
            with torch.inference_mode():
                out = self.split.text_trunk(self.split.tokenizer(chunk)).float().numpy()
            for text, row in zip(chunk, out, strict=True):
                self.rows[text] = len(self.feats)
                self.feats.append(row)
        return torch.tensor([self.rows[t] for t in texts], dtype=torch.long)

    def encode(self, ids: Any) -> Any:
        import torch

        rows = torch.from_numpy(np.stack([self.feats[i] for i in ids.tolist()]))
        return self.split.text_head(rows)

    def save(self) -> None:
        if self.path is not None and len(self.feats) > self.num_loaded:
            texts = np.array(sorted(self.rows, key=self.rows.__getitem__))
            _save_npz(self.path, texts=texts, features=np.stack(self.feats).astype(np.float32))
            self.num_loaded = len(self.feats)


class HeadsModel:
    """What clip-benchmark drives for a frozen-tower model: ``encode_image`` takes cached trunk features
    [b, D] (2-d input) or images [b, 3, S, S], whose trunk features it records (the cold pass);
    ``encode_text`` takes :class:`TextTable` row ids."""

    def __init__(self, split: FrozenSplit, table: TextTable):
        self.split, self.table, self.recorded = split, table, []

    def encode_image(self, x: Any) -> Any:
        import torch

        from toolkit.models.inference import IMAGE_BATCH, to_channels_last

        if x.ndim == 2:
            return self.split.image_head(x)
        with torch.inference_mode():  # the trunk in batches of IMAGE_BATCH: the fastest size on a CPU
            feats = torch.cat(
                [
                    self.split.image_trunk(to_channels_last(x[i : i + IMAGE_BATCH]))
                    for i in range(0, x.shape[0], IMAGE_BATCH)
                ]
            ).float()
        self.recorded.append(feats.numpy())
        return self.split.image_head(feats)

    def encode_text(self, ids: Any) -> Any:
        return self.table.encode(ids)


class _Recording:
    """Wraps the cold loader (which also yields image digests): yields (images, labels) and keeps each
    sample's label and digest, in order."""

    def __init__(self, loader: Any):
        self.loader, self.dataset, self.labels, self.digests = loader, loader.dataset, [], []

    def __iter__(self):
        for images, labels, digests in self.loader:
            self.labels.extend(labels.tolist() if hasattr(labels, "tolist") else labels)
            self.digests.extend(digests)
            yield images, labels


class _CachedLoader:
    """Batches of (trunk features [b, D], labels) from a cache hit; ``.dataset.classes`` for
    clip-benchmark."""

    def __init__(self, feats: np.ndarray, labels: list, batch_size: int, classes: list[str] | None):
        self.feats, self.labels, self.batch_size = feats, labels, batch_size
        self.dataset = type("CachedSet", (), {"classes": classes})()

    def __len__(self) -> int:
        return -(-len(self.labels) // self.batch_size)

    def __iter__(self):
        import torch

        for i in range(0, len(self.labels), self.batch_size):
            labels = self.labels[i : i + self.batch_size]
            if labels and isinstance(labels[0], int):
                labels = torch.tensor(labels, dtype=torch.long)
            yield torch.from_numpy(self.feats[i : i + self.batch_size]), labels


def read_labels_and_digests(eval_set: EvalSet) -> tuple[list, list[str]]:
    """Each sample's label (or captions) and the SHA-1 of its encoded image, in the set's order, without
    decoding any image (tar reads and hashing: ~0.1 s for 1,900 emoji PNGs)."""
    import webdataset as wds

    from toolkit.eval.datasets import image_bytes_of, label_of

    labels, digests = [], []
    for sample in wds.WebDataset(
        list(eval_set.shards), shardshuffle=False, nodesplitter=lambda src: src, empty_check=False
    ):
        digests.append(hashlib.sha1(image_bytes_of(sample, eval_set)[1]).hexdigest())
        labels.append(label_of(sample, eval_set))
    return labels, digests


@dataclass
class ImageTable:
    """SHA-1 of encoded image bytes -> image-trunk features [D] of one tower (``images.npz``)."""

    path: Path | None
    rows: dict[str, int] = field(default_factory=dict)
    feats: np.ndarray | None = None
    num_loaded: int = 0

    @classmethod
    def open(cls, path: Path | None) -> ImageTable:
        table = cls(path)
        data = _load_npz(path, ("digests", "features")) if path else None
        if data is not None and len(data["digests"]) == len(data["features"]):
            table.rows = {str(d): i for i, d in enumerate(data["digests"])}
            table.feats, table.num_loaded = data["features"], len(data["digests"])
        return table

    def lookup(self, digests: list[str]) -> np.ndarray | None:
        """Features [n, D] of these images in order, or None unless every one is in the table."""
        if self.feats is None or any(d not in self.rows for d in digests):
            return None
        return self.feats[[self.rows[d] for d in digests]]

    def add(self, digests: list[str], feats: np.ndarray) -> None:
        seen, new = set(self.rows), []
        for i, d in enumerate(digests):  # a set may hold the same image twice: store it once
            if d not in seen:
                seen.add(d)
                new.append(i)
        if not new:
            return
        base = 0 if self.feats is None else len(self.feats)
        for j, i in enumerate(new):
            self.rows[digests[i]] = base + j
        add = feats[new].astype(np.float32)
        self.feats = add if self.feats is None else np.concatenate([self.feats, add])

    def save(self) -> None:
        if self.path is not None and self.feats is not None and len(self.feats) > self.num_loaded:
            digests = np.array(sorted(self.rows, key=self.rows.__getitem__))
            _save_npz(self.path, digests=digests, features=self.feats)
            self.num_loaded = len(self.feats)


@dataclass
class FrozenEval:
    """One evaluation's frozen-tower state: the split model, its image and text tables (cache files under
    ``root/<tower fingerprint>``, or in memory only when ``root`` is None)."""

    split: FrozenSplit
    images: ImageTable
    texts: TextTable

    @classmethod
    def open(cls, split: FrozenSplit, root: Path | None, tower: str) -> FrozenEval:
        folder = None if root is None else root / tower
        return cls(
            split,
            ImageTable.open(folder / "images.npz" if folder else None),
            TextTable.open(split, folder / "texts.npz" if folder else None),
        )

    def inputs(self, eval_set: EvalSet, make_loader: Any, batch_size: int) -> tuple[HeadsModel, Any, Any]:
        """(model, loader, finish) for clip-benchmark. When every image of the set is in the table (by the
        SHA-1 of its bytes) the loader yields stored trunk features and nothing is decoded; otherwise it
        yields images and ``finish()`` adds the recorded features. ``finish()`` saves the tables and returns
        True for a hit. ``make_loader(with_digest=True)`` must build the set's image loader."""
        model = HeadsModel(self.split, self.texts)
        labels, digests = read_labels_and_digests(eval_set)
        feats = self.images.lookup(digests)
        if feats is not None:
            loader = _CachedLoader(feats, labels, batch_size, list(eval_set.classnames) or None)
            return model, loader, lambda: (self.texts.save(), True)[1]
        loader = _Recording(make_loader(with_digest=True))

        def finish() -> bool:
            if model.recorded and loader.digests:
                self.images.add(loader.digests, np.concatenate(model.recorded))
            self.images.save()
            self.texts.save()
            return False

        return model, loader, finish
