"""Model weights on disk, in open_clip's ``local-dir:`` layout: ``open_clip_config.json`` + safetensors
weights.

A cliptk checkpoint directory holds exactly what ``open_clip.create_model_and_transforms('local-dir:DIR')``
reads:
- ``open_clip_config.json``: ``{"model_cfg": <open_clip model config>, "preprocess_cfg": {size, mean, std,
  interpolation, resize_mode, ...}}``;
- ``open_clip_model.safetensors``: the model's state dict (no ``module.``/``_orig_mod.`` prefixes).
The trainer keeps its own state (optimiser, schedules, FastCLIP tables) in other files beside these;
open_clip ignores them because it prefers ``open_clip_model.safetensors`` among the weight files.

:func:`save_model` writes the directory atomically: everything goes into a temporary sibling directory
that is renamed into place, so a reader never sees a config without its weights.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toolkit.core import files
from toolkit.models.registry import config_image_size

CONFIG_NAME = "open_clip_config.json"
WEIGHTS_NAME = "open_clip_model.safetensors"
# Weight files accepted for ``--weights`` and inside a checkpoint directory (open_clip reads all of them).
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin")
# open_clip's own preference among weight files in a local dir (factory._find_checkpoint_in_dir).
PREFERRED_WEIGHTS = (
    "open_clip_model.safetensors",
    "open_clip_pytorch_model.safetensors",
    "open_clip_pytorch_model.bin",
    "open_clip_pytorch_model.pth",
    "model.safetensors",
    "pytorch_model.bin",
    "pytorch_model.pth",
    "model.pth",
)


class CheckpointError(FileNotFoundError):
    """A checkpoint directory or weights file is missing or unreadable; the message names the file."""


def default_preprocess_cfg(model_cfg: dict[str, Any]) -> dict[str, Any]:
    """open_clip's default inference preprocessing (OpenAI mean/std, bicubic) at the model's resolution."""
    import dataclasses

    from open_clip.transform import PreprocessCfg

    cfg = dataclasses.asdict(PreprocessCfg())
    cfg["size"] = config_image_size(model_cfg)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}


def unwrap_model(model: Any) -> Any:
    """The plain module inside DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def state_dict_for_saving(model: Any) -> dict[str, Any]:
    """CPU, contiguous, unshared tensors of the unwrapped model (safetensors rejects shared storage)."""
    state = unwrap_model(model).state_dict()
    out, seen = {}, set()
    for key, tensor in state.items():
        t = tensor.detach().cpu().contiguous()
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else None
        if ptr is not None and ptr in seen:
            t = t.clone()
        if ptr is not None:
            seen.add(ptr)
        out[key] = t
    return out


def model_files(
    model: Any, model_cfg: dict[str, Any], preprocess_cfg: dict[str, Any] | None = None
) -> dict[str, bytes]:
    """The two files of an open_clip ``local-dir:`` model, serialised in memory: {CONFIG_NAME: JSON bytes,
    WEIGHTS_NAME: safetensors bytes}. ``preprocess_cfg`` defaults to the model's or open_clip's."""
    from open_clip import get_model_preprocess_cfg
    from safetensors.torch import save

    if preprocess_cfg is None:
        preprocess_cfg = {
            **default_preprocess_cfg(model_cfg),
            **(get_model_preprocess_cfg(unwrap_model(model)) or {}),
        }
    config = {"model_cfg": model_cfg, "preprocess_cfg": _plain(preprocess_cfg)}
    return {
        CONFIG_NAME: (json.dumps(config, indent=2) + "\n").encode(),
        WEIGHTS_NAME: save(state_dict_for_saving(model), metadata={"format": "pt"}),
    }


def save_model(
    model: Any,
    model_cfg: dict[str, Any],
    out_dir: str | os.PathLike,
    preprocess_cfg: dict[str, Any] | None = None,
    write_extra: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``out_dir`` (config + safetensors weights) atomically; returns its path.

    ``model_cfg`` is the open_clip config the model was built from (``LoadedModel.model_cfg``);
    ``preprocess_cfg`` defaults to the model's ``visual.preprocess_cfg`` or open_clip's defaults.
    ``write_extra(tmp_dir)`` may add more files that then appear in the same atomic rename. An existing
    ``out_dir`` is replaced as a whole. Called by one process (rank 0).
    """
    target = Path(out_dir)
    with files.replacing_dir(target) as tmp:
        for name, data in model_files(model, model_cfg, preprocess_cfg).items():
            (tmp / name).write_bytes(data)
        if write_extra is not None:
            write_extra(tmp)
    return target


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=lambda v: list(v) if isinstance(v, tuple) else str(v)))


def is_checkpoint_dir(path: str | os.PathLike) -> bool:
    """True when ``path`` holds a complete model checkpoint (config and ``open_clip_model.safetensors``)."""
    return (Path(path) / CONFIG_NAME).is_file() and (Path(path) / WEIGHTS_NAME).is_file()


def read_checkpoint_config(ckpt_dir: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model_cfg, preprocess_cfg) from ``ckpt_dir/open_clip_config.json``; errors name the file."""
    path = Path(ckpt_dir) / CONFIG_NAME
    if not Path(ckpt_dir).is_dir():
        raise CheckpointError(f"checkpoint directory not found: {ckpt_dir}")
    if not path.is_file():
        inner = [
            Path(ckpt_dir) / sub
            for sub in ("model", "model-ema")
            if (Path(ckpt_dir) / sub / CONFIG_NAME).is_file()
        ]
        hint = f"; a training run's model is {inner[0]}" if inner else ""  # `--model RUN`, for RUN/model
        raise CheckpointError(
            f"{path}: missing; a checkpoint directory needs {CONFIG_NAME} and {WEIGHTS_NAME}{hint}"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: not readable JSON: {err}") from err
    if not isinstance(data, dict) or not isinstance(data.get("model_cfg"), dict):
        raise CheckpointError(f"{path}: expected an object with a 'model_cfg' mapping (open_clip's schema)")
    model_cfg = data["model_cfg"]
    return model_cfg, {**default_preprocess_cfg(model_cfg), **(data.get("preprocess_cfg") or {})}


def find_weights(ckpt_dir: str | os.PathLike) -> Path:
    """The weights file open_clip would load from ``ckpt_dir`` (``open_clip_model.safetensors`` first)."""
    root = Path(ckpt_dir)
    for name in PREFERRED_WEIGHTS:
        if (root / name).is_file():
            return root / name
    others = sorted(p for p in root.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not others:
        raise CheckpointError(
            f"{root / WEIGHTS_NAME}: missing; no weights file "
            f"({', '.join(WEIGHT_SUFFIXES)}) in checkpoint directory {root}"
        )
    return sorted(others, key=lambda p: p.suffix != ".safetensors")[0]


def check_weights_file(path: str | os.PathLike) -> Path:
    """``path`` as a Path if it is an existing weights file with a known suffix, else CheckpointError."""
    p = Path(path)
    if p.is_dir():
        hint = (
            "; a checkpoint directory is a model: pass it as the model itself (--model DIR)"
            if is_checkpoint_dir(p)
            else ""
        )
        raise CheckpointError(f"weights: {p} is a directory, not a weights file{hint}")
    if not p.is_file():
        raise CheckpointError(f"weights file not found: {p}")
    if p.suffix not in WEIGHT_SUFFIXES:
        raise CheckpointError(
            f"{p}: unknown weights format {p.suffix!r}; expected {', '.join(WEIGHT_SUFFIXES)}"
        )
    return p


def load_weights(model: Any, path: str | os.PathLike) -> None:
    """Load a full CLIP state dict into ``model`` strictly (open_clip's loader: safetensors, torch
    pickles with weights_only, ``state_dict``/``module.`` wrappers); errors name the file."""
    import open_clip

    p = check_weights_file(path)
    try:
        open_clip.load_checkpoint(model, str(p), strict=True, weights_only=True)
    except Exception as err:  # noqa: BLE001 - first: do the names and shapes differ? (a few lines, not a dump)
        from toolkit.models.weightdiff import describe_mismatch

        diff = describe_mismatch(model, p)
        if diff is not None:
            raise ValueError(f"{p}: weights do not match the model config: {diff}") from None
        _raise_load_error(p, err)


def _raise_load_error(p: Path, err: Exception) -> None:
    """The error of a load whose names and shapes matched: a mismatch open_clip found, or an unreadable
    file."""
    try:
        raise err
    except (
        RuntimeError,
        AssertionError,
    ) as err:  # missing/unexpected keys, shape mismatches (open_clip asserts)
        raise ValueError(f"{p}: weights do not match the model config: {str(err)[:1500]}") from err
    except Exception as err:  # noqa: BLE001 - corrupt files raise many kinds; report them with the file name
        raise CheckpointError(f"{p}: could not read weights: {type(err).__name__}: {err}") from err
