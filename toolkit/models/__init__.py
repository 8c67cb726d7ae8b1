"""CLIP towers through open_clip: named or custom configs, tokenizers, model weights, frozen towers."""

from toolkit.models.factory import LoadedModel, build_model, load_model, resolve_spec
from toolkit.models.registry import (
    context_length,
    image_size,
    model_config,
    register_builtin_configs,
    tokenizer,
)
from toolkit.models.weights import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    find_weights,
    is_checkpoint_dir,
    load_weights,
    read_checkpoint_config,
    save_model,
    unwrap_model,
)

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "CheckpointError",
    "LoadedModel",
    "build_model",
    "context_length",
    "find_weights",
    "image_size",
    "is_checkpoint_dir",
    "load_model",
    "load_weights",
    "model_config",
    "read_checkpoint_config",
    "register_builtin_configs",
    "resolve_spec",
    "save_model",
    "tokenizer",
    "unwrap_model",
]
