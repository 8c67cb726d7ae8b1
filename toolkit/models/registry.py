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


@cache
def register_builtin_configs() -> tuple[str, ...]:
    """Add cliptk's configs to open_clip's registry (idempotent); returns their names."""
    import open_clip

    for path in sorted(CONFIG_DIR.glob("*.json")):
        open_clip.add_model_config(path)
    return tuple(sorted(p.stem for p in CONFIG_DIR.glob("*.json")))


def model_config(name: str) -> dict[str, Any]:
    """open_clip config dict for a registered name or a path to a config JSON (ValueError if neither)."""
    if name.endswith(".json") and Path(name).is_file():
        data = json.loads(Path(name).read_text())
        return data.get("model_cfg", data)
    import open_clip

    register_builtin_configs()
    cfg = open_clip.get_model_config(name)
    if cfg is None:
        raise ValueError(f"unknown model {name!r}: not an open_clip config name nor a config JSON file; "
                         f"cliptk's own: {', '.join(register_builtin_configs())}")
    return cfg


def image_size(name: str) -> int:
    """Square input resolution of the model's image tower, in pixels."""
    size = model_config(name)["vision_cfg"].get("image_size", 224)
    return int(size[0] if isinstance(size, (list, tuple)) else size)


def context_length(name: str) -> int:
    return int(model_config(name).get("text_cfg", {}).get("context_length", 77))


def tokenizer(name: str):
    """The model's tokenizer: callable list[str] -> LongTensor [n, context_length] (offline, bundled BPE)."""
    import open_clip

    register_builtin_configs()
    if name.endswith(".json"):
        return open_clip.SimpleTokenizer(context_length=context_length(name))
    return open_clip.get_tokenizer(name)
