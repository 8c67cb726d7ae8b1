"""CLIP towers through open_clip: named or custom configs, tokenizers, checkpoints, frozen towers."""

from toolkit.models.registry import (
    context_length,
    image_size,
    model_config,
    register_builtin_configs,
    tokenizer,
)

__all__ = ["context_length", "image_size", "model_config", "register_builtin_configs", "tokenizer"]
from toolkit.models.checkpoint import (  # noqa: E402
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
from toolkit.models.factory import LoadedModel, build_model, load_model, make_tokenizer, resolve_spec  # noqa: E402

__all__ += ["CONFIG_NAME", "WEIGHTS_NAME", "CheckpointError", "LoadedModel", "build_model", "find_weights",
            "is_checkpoint_dir", "load_model", "load_weights", "make_tokenizer", "read_checkpoint_config",
            "resolve_spec", "save_model", "unwrap_model"]
