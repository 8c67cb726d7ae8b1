"""CLIP towers through open_clip: named or custom configs, tokenizers, checkpoints, frozen towers."""

from toolkit.models.registry import (
    context_length,
    image_size,
    model_config,
    register_builtin_configs,
    tokenizer,
)

__all__ = ["context_length", "image_size", "model_config", "register_builtin_configs", "tokenizer"]
