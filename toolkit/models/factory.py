"""One way to get a CLIP model: :func:`load_model` from a checkpoint dir, a config name or JSON, weights.

``spec`` may be
- a cliptk/open_clip checkpoint directory (``open_clip_config.json`` + weights; ``local-dir:`` prefix
  allowed);
- an open_clip model name (``ViT-B-32``, cliptk's ``cliptk-tiny``, ``cliptk-small``) or a config JSON file,
  with ``weights=`` a local ``.safetensors/.pt/.pth/.bin`` file, or no weights for a random init.
Nothing is ever downloaded: pretrained tags are not accepted, and HF/timm tower weights are not fetched.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from toolkit.core.log import get_logger
from toolkit.models.registry import (
    config_context_length,
    config_image_size,
    hf_model_path,
    model_config,
    tokenizer,
)
from toolkit.models.weights import (
    CONFIG_NAME,
    WEIGHT_SUFFIXES,
    CheckpointError,
    check_weights_file,
    default_preprocess_cfg,
    find_weights,
    load_weights,
    read_checkpoint_config,
)

PRECISIONS = ("fp32", "bf16", "fp16", "pure_bf16", "pure_fp16")
LOCAL_DIR_PREFIX = "local-dir:"


@dataclasses.dataclass
class LoadedModel:
    """A ready model and what goes with it. Unpacks as ``model, tokenizer, image_size = loaded``.

    - ``model``: open_clip ``CLIP``/``CustomTextCLIP`` in eval mode on ``device``; ``encode_image([N,3,S,S])
      -> [N,D]``, ``encode_text([N,L] int64) -> [N,D]`` (not normalised), ``logit_scale`` parameter.
    - ``tokenizer``: ``list[str] -> LongTensor [N, context_length]``.
    - ``preprocess``: inference transform, PIL image -> float tensor ``[3, S, S]``.
    - ``weights_sha256``: the weights file's sha256 when loading read it anyway (a training checkpoint's
      ``checkpoint.json`` check), else None: nothing reads a large file only to hash it.
    """

    model: Any
    tokenizer: Callable[[list[str]], Any]
    image_size: int
    preprocess: Callable[[Any], Any]
    model_cfg: dict[str, Any]
    preprocess_cfg: dict[str, Any]
    name: str
    weights: str | None
    context_length: int
    weights_sha256: str | None = None

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.tokenizer, self.image_size))


@dataclasses.dataclass(frozen=True)
class ResolvedSpec:
    """Where a model comes from: config, preprocessing, weights file (None: random init), tokenizer source."""

    name: str
    model_cfg: dict[str, Any]
    preprocess_cfg: dict[str, Any]
    weights: Path | None
    tokenizer_source: (
        str  # what registry.tokenizer() takes: 'local-dir:DIR', a registered name or a config JSON
    )


def resolve_spec(spec: str, weights: str | None = None) -> ResolvedSpec:
    """Turn a model spec (see module docstring) into config + weights; errors name what is missing."""
    spec = str(spec)
    if spec.startswith(LOCAL_DIR_PREFIX) or Path(spec).is_dir():
        directory = Path(spec.removeprefix(LOCAL_DIR_PREFIX))
        model_cfg, pp = read_checkpoint_config(directory)
        found = check_weights_file(weights) if weights else find_weights(directory)
        return ResolvedSpec(directory.name, model_cfg, pp, found, f"{LOCAL_DIR_PREFIX}{directory}")
    if spec.endswith(".json"):
        if not Path(spec).is_file():
            raise CheckpointError(f"model config file not found: {spec}")
    elif "/" in spec or Path(spec).suffix in WEIGHT_SUFFIXES:
        raise CheckpointError(
            f"model not found: {spec} is neither a checkpoint directory (with "
            f"{CONFIG_NAME}) nor a config JSON nor a model name"
        )
    model_cfg = model_config(spec)  # ValueError naming cliptk's configs for unknown names
    found = check_weights_file(weights) if weights else None
    name = Path(spec).stem if spec.endswith(".json") else spec
    return ResolvedSpec(name, model_cfg, default_preprocess_cfg(model_cfg), found, spec)


def build_model(model_cfg: dict[str, Any], precision: str = "fp32") -> Any:
    """A randomly initialised open_clip model for ``model_cfg`` on CPU (fp32 parameters; the ``cast_dtype``
    of ``precision`` only changes which dtype the towers compute in). Tower weights are never fetched."""
    import open_clip

    cfg = copy.deepcopy(model_cfg)  # the caller's config stays as given (it is saved with checkpoints)
    vision_cfg, text_cfg = cfg.setdefault("vision_cfg", {}), cfg.setdefault("text_cfg", {})
    if "timm_model_name" in vision_cfg:
        vision_cfg["timm_model_pretrained"] = False  # would download ImageNet weights
    if "hf_model_name" in text_cfg:
        text_cfg["hf_model_pretrained"] = False
        text_cfg["hf_model_name"] = hf_model_path(
            text_cfg["hf_model_name"]
        )  # a packaged model's local folder
    custom_text = cfg.pop("custom_text", False) or "hf_model_name" in text_cfg
    if "multimodal_cfg" in cfg:
        raise ValueError("CoCa (captioning) configs are not supported by cliptk; use a CLIP config")
    cls = open_clip.CustomTextCLIP if custom_text else open_clip.CLIP
    return cls(**cfg, cast_dtype=open_clip.get_cast_dtype(precision))


def to_device_precision(model: Any, device: str, precision: str, is_timm: bool = False) -> Any:
    """Move to ``device`` and convert like open_clip: 'fp16'/'bf16' cast matmul weights (LayerNorm stays
    fp32), 'pure_*' casts everything, 'fp32' leaves parameters alone."""
    import open_clip
    import torch

    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
    dtype = torch.bfloat16 if "bf16" in precision else torch.float16
    # open_clip's low-precision weight conversion only knows its native towers: cast timm towers whole.
    if precision.startswith("pure_") or (precision != "fp32" and is_timm):
        return model.to(device=device, dtype=dtype)
    model.to(device=device)
    if precision != "fp32":
        open_clip.convert_weights_to_lp(model, dtype=dtype)
    return model


def eval_transform(preprocess_cfg: dict[str, Any]) -> Callable[[Any], Any]:
    """open_clip's inference transform (PIL image -> float tensor [3, S, S]) for a preprocess config."""
    import open_clip

    pp = open_clip.transform.PreprocessCfg(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in preprocess_cfg.items()}
    )
    return open_clip.transform.image_transform_v2(pp, is_train=False)


def load_model(
    spec: str,
    *,
    weights: str | None = None,
    device: str = "cpu",
    precision: str = "fp32",
    seed: int | None = None,
) -> LoadedModel:
    """Build the model for ``spec``, load its weights strictly (random init when there are none), move it
    to ``device`` in ``precision`` and put it in eval mode. ``seed`` makes a random init reproducible.

    Called on every rank that needs the model; reads only local files.
    """
    import open_clip
    import torch

    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {', '.join(PRECISIONS)}")
    resolved = resolve_spec(spec, weights)
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        model = build_model(resolved.model_cfg, precision)
    weights_sha256 = None
    if resolved.weights is not None:
        from toolkit.models.trust import check_finite, verify_recorded

        # a training checkpoint: the sizes and sha256 it recorded
        weights_sha256 = verify_recorded(resolved.weights.parent).get(resolved.weights.name)
        load_weights(model, resolved.weights)
        check_finite(model, str(resolved.weights))
    else:
        get_logger("models").warning(
            "model %s: no weights given, using a random initialisation", resolved.name
        )
    is_timm = "timm_model_name" in resolved.model_cfg.get("vision_cfg", {})
    model = to_device_precision(model, device, precision, is_timm).eval()
    open_clip.set_model_preprocess_cfg(model, resolved.preprocess_cfg)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer(resolved.tokenizer_source),
        image_size=config_image_size(resolved.model_cfg),
        preprocess=eval_transform(resolved.preprocess_cfg),
        model_cfg=resolved.model_cfg,
        preprocess_cfg=resolved.preprocess_cfg,
        name=resolved.name,
        weights=str(resolved.weights) if resolved.weights else None,
        context_length=config_context_length(resolved.model_cfg),
        weights_sha256=weights_sha256,
    )
