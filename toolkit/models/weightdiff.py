"""What differs between a weights file and the model it is loaded into, in a few lines.

open_clip's strict load reports an architecture mismatch as PyTorch's full key dump (cut mid-word by the
caller, and printed twice), and weights of a pixel model loaded under a LiT config fail inside open_clip
with ``AttributeError: 'NoneType' object has no attribute 'shape'``, as if the file were unreadable.
:func:`describe_mismatch` compares the file's tensor names and shapes with the model's and says what the
weights fit: how many tensors are missing, extra or of another shape, with a few examples, and the
top-level parts each side has that the other lacks. Called by :func:`toolkit.models.weights.load_weights`
when a load fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

NUM_EXAMPLES = 3


def file_shapes(path: str | Path) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape of a weights file (safetensors, or a torch file read with weights_only), with
    open_clip's ``state_dict``/``module.`` wrappers removed; None when it cannot be read at all."""
    path = Path(path)
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as fh:
                return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
        import torch

        data = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - unreadable for any reason: the caller reports the original error
        return None
    if isinstance(data, dict) and isinstance(data.get("state_dict"), dict):
        data = data["state_dict"]
    if not isinstance(data, dict):
        return None
    return {k.removeprefix("module."): tuple(getattr(v, "shape", ())) for k, v in data.items()}


def _parts(names: set[str]) -> set[str]:
    return {".".join(n.split(".")[:2]) for n in names}


def _examples(names: list[str]) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > NUM_EXAMPLES else ""
    return ", ".join(names[:NUM_EXAMPLES]) + more


def describe_mismatch(model: Any, path: str | Path) -> str | None:
    """A few lines on how the weights in ``path`` differ from ``model`` (a torch module); None when the
    file cannot be read or its names and shapes match the model's (the failure lies elsewhere)."""
    have = file_shapes(path)
    if have is None:
        return None
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    shapes = [
        f"{k} (file {list(have[k])}, model {list(want[k])})"
        for k in sorted(set(want) & set(have))
        if have[k] != want[k]
    ]
    if not (missing or extra or shapes):
        return None
    lines = []
    only_file, only_model = (
        sorted(_parts(set(extra)) - _parts(set(want))),
        sorted(_parts(set(missing)) - _parts(set(have))),
    )
    if only_file or only_model:
        lines.append(
            f"the weights fit a model with {', '.join(only_file) or 'no other parts'}; this config has "
            f"{', '.join(only_model) or 'no other parts'} instead"
        )
    if missing:
        lines.append(f"{len(missing)} tensors of the model are not in the file: {_examples(missing)}")
    if extra:
        lines.append(f"{len(extra)} tensors of the file are not in the model: {_examples(extra)}")
    if shapes:
        lines.append(f"{len(shapes)} tensors differ in shape: {_examples(shapes)}")
    return "; ".join(lines)
