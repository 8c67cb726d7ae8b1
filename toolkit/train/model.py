"""The model the trainer steps: an open_clip CLIP fed straight from training-shard batches.

``TrainModel.forward(image, text) -> (x [b, E], y [b, E], a[, bias])``: L2-normalised image and text
features, the logit scale a = exp(p) and, for models built with a logit bias (sigmoid losses), the bias.
``image`` is uint8 pixels [b, S, S, 3] (normalised on the device with the
model's mean/std, so only bytes cross the host-device link) or frozen-tower features [b, D_img]; ``text``
is token ids [b, L] or frozen-tower features [b, D_txt]. Feature inputs go through the tower's
projection head only (the frozen trunk never runs in training); the saved model is the whole open_clip
model, tower + head, so it encodes raw images and text at evaluation.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.functional import normalize

from toolkit.core.log import get_logger
from toolkit.models import frozen, text_trim
from toolkit.models.factory import build_model, resolve_spec
from toolkit.models.registry import config_context_length, config_image_size
from toolkit.models.weights import check_weights_file, load_weights


class Towers(NamedTuple):
    """What ``TrainModel`` returns for one batch of b pairs."""

    image_features: Tensor  # x [b, E], L2-normalised
    text_features: Tensor  # y [b, E], L2-normalised
    logit_scale: Tensor  # a = exp(p), 0-d
    logit_bias: Tensor | None  # the learnable bias (0-d) of sigmoid models, else None

    def scalars(self) -> list[Tensor]:
        """[a] or [a, bias]: the learnable scalars the objective receives beside the features."""
        return [self.logit_scale] if self.logit_bias is None else [self.logit_scale, self.logit_bias]


class TrainModel(nn.Module):
    """Batch tensors -> (x, y, a) (module docstring). ``clip`` is the open_clip model that gets saved."""

    def __init__(
        self,
        clip: nn.Module,
        image_role: str,
        text_role: str,
        mean: tuple[float, ...],
        std: tuple[float, ...],
    ):
        super().__init__()
        self.clip, self.image_role, self.text_role = clip, image_role, text_role
        # token batches are cut after their last pooled position (models/text_trim: same features and grads)
        self.trims_text = text_role == "tokens" and text_trim.trimmable(clip)
        self.image_px = 0  # a resolution stage's image side (train/stages.py); 0: the pixels as they come
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)

    def encode_image(self, image: Tensor) -> Tensor:
        if self.image_role == "image_features":
            return frozen.head_forward(self.clip, "image", image.float())  # stored as float16
        pixels = image.permute(0, 3, 1, 2).float().div_(255.0)
        if self.image_px:
            from toolkit.models.resolution import resize_pixels

            pixels = resize_pixels(pixels, self.image_px)
        return self.clip.encode_image((pixels - self.mean) / self.std)

    def encode_text(self, text: Tensor) -> Tensor:
        if self.text_role == "text_features":
            return frozen.head_forward(self.clip, "text", text.float())
        if self.trims_text:
            return text_trim.encode_text(self.clip, text)
        return self.clip.encode_text(text)

    def trim_tokens(self, text: Tensor) -> Tensor:
        """A host batch of token ids [b, L] cut to the columns the text tower needs (``models.text_trim``;
        unchanged when the tower is not causal with one pooled position, or the text is features)."""
        if not self.trims_text:
            return text
        return text_trim.trim_tokens(text, self.clip.text_pool_type, self.clip.text_eos_id)

    def forward(self, image: Tensor, text: Tensor) -> Towers:
        """``Towers``: x [b, E], y [b, E], a (0-d), and the logit bias (0-d) when the open_clip model has
        one (``init_logit_bias``: sigmoid losses), else None."""
        x = normalize(self.encode_image(image), dim=-1)
        y = normalize(self.encode_text(text), dim=-1)
        bias = getattr(self.clip, "logit_bias", None)
        return Towers(x, y, self.clip.logit_scale.exp(), None if bias is None else bias.reshape(()))


@dataclass
class BuiltModel:
    """The trainable model and what saving it needs (the open_clip config it was built from)."""

    model: TrainModel
    model_cfg: dict[str, Any]
    preprocess_cfg: dict[str, Any]
    name: str
    init_weights: str | None


def _init_source(model_spec: str, init: str) -> tuple[Any, str | None]:
    """(resolved spec, weights file or None): ``init`` (checkpoint dir or file) wins over the model's own."""
    spec = resolve_spec(model_spec)
    if not init:
        return spec, str(spec.weights) if spec.weights else None
    if init.startswith("local-dir:") or os.path.isdir(init):
        return spec, str(resolve_spec(init).weights)  # a checkpoint directory: the file open_clip would load
    return spec, str(check_weights_file(init))


def fitted_config(spec: Any, dataset: Any) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """(model_cfg, preprocess_cfg, towers) of resolved model ``spec`` for ``dataset``: each side whose
    features the data holds gets its frozen tower + a head (``towers``: any side does). Reads dataset.json
    only (cheap)."""
    towers = bool(dataset.field("image_features") or dataset.field("text_features"))
    model_cfg, preprocess_cfg = spec.model_cfg, spec.preprocess_cfg
    if towers:
        model_cfg, preprocess_cfg = frozen.config_for_dataset(model_cfg, preprocess_cfg, dataset.extra)
    return model_cfg, preprocess_cfg, towers


def check_fit(model_spec: str, dataset: Any) -> None:
    """Refuse ``dataset`` when it does not fit model ``model_spec`` (pixels, tokens, or frozen-tower
    features: the model it would be trained as). Cheap (dataset.json only); preflight calls it before
    launching, and ``build`` on every rank."""
    check_dataset(fitted_config(resolve_spec(model_spec), dataset)[0], dataset, model_spec)


def build(
    model_spec: str,
    init: str,
    dataset: Any,
    tau_init: float,
    learn_tau: bool,
    seed: int,
    *,
    logit_bias: float | None = None,
) -> BuiltModel:
    """Build the open_clip model for ``model_spec`` (with frozen towers where ``dataset`` holds their
    features), load ``init`` or seed a random init, check the data fits it (always: the check is cheap,
    and LiT data must be checked against the frozen-tower model), set up the logit scale.
    Called by every rank with the same arguments (DDP then starts from identical weights).
    ``logit_bias``: give the model open_clip's learnable logit bias starting there (``init_logit_bias``,
    saved in its config, so the checkpoint loads in plain open_clip; sigmoid losses); weights that carry
    a bias override it, weights without one start it at 0 (open_clip's loader)."""
    spec, weights = _init_source(model_spec, init)
    model_cfg, preprocess_cfg, towers = fitted_config(spec, dataset)
    if logit_bias is not None:
        model_cfg = {**model_cfg, "init_logit_bias": float(logit_bias)}
    check_dataset(model_cfg, dataset, model_spec)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        clip = build_model(model_cfg)
    if towers:
        frozen.load_frozen_towers(clip, dataset.extra)
    if weights:
        load_weights(clip, weights)
    else:
        with torch.no_grad():
            clip.logit_scale.fill_(math.log(1.0 / tau_init))
    if towers:
        frozen.freeze_towers(clip, dataset.extra)
    clip.logit_scale.requires_grad_(learn_tau)
    image_role = "image_features" if dataset.field("image_features") else "image"
    text_role = "text_features" if dataset.field("text_features") else "tokens"
    mean, std = preprocess_cfg["mean"], preprocess_cfg["std"]
    get_logger("train").info(
        "model %s: %.2fM trainable of %.2fM parameters%s",
        spec.name,
        sum(p.numel() for p in clip.parameters() if p.requires_grad) / 1e6,
        sum(p.numel() for p in clip.parameters()) / 1e6,
        f", weights from {weights}" if weights else ", random init",
    )
    return BuiltModel(
        TrainModel(clip, image_role, text_role, tuple(mean), tuple(std)),
        model_cfg,
        preprocess_cfg,
        spec.name,
        weights,
    )


def check_dataset(model_cfg: dict[str, Any], dataset: Any, model_spec: str) -> None:
    """Refuse a dataset whose image size, context length or feature dims do not fit the model (before
    step 1), naming both sides."""
    where = f"training data {dataset.root}"
    image = dataset.field("image")
    side = image and (
        dataset.extra.get("image_size") or image.shape[0]
    )  # the model's side, without crop margin
    if image is not None and (side != config_image_size(model_cfg) or image.shape[0] < side):
        raise ValueError(
            f"{where} holds {side} px images but model {model_spec} expects "
            f"{config_image_size(model_cfg)} px: re-run `toolkit data precompute --model {model_spec}`"
        )
    tokens = dataset.field("tokens")
    if tokens is not None and tokens.shape[0] != config_context_length(model_cfg):
        raise ValueError(
            f"{where} holds {tokens.shape[0]} tokens per caption but model {model_spec} has context "
            f"length {config_context_length(model_cfg)}: re-run precompute with --model {model_spec}"
        )
    if dataset.field("image_features") or dataset.field("text_features"):
        frozen.check_feature_dims(model_cfg, dataset, model_spec)
