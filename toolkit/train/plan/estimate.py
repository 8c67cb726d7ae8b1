"""Activation constants for planning a CUDA job on a machine without a GPU (a laptop): an estimate
calibrated on the one CUDA peak the project has measured, labelled as such wherever it is printed.

The measurement: ``python -m benchmarks.gpu.check`` on one H100 (benchmarks/gpu/results/gpu_check_h100.md,
gpu_check_h100_trainer.json): `toolkit train --model ViT-B-32 --precision bf16 --batch-size 512` (openclip,
no gradient cache, one device, captions of at most 12 tokens) peaked at 11.72 GiB
(``torch.cuda.max_memory_allocated``). Subtracting the planner's arithmetic rows (weights, gradients, AdamW
state, batch inputs, loss buffers) leaves the activations of 512 samples; they are taken as all per-sample
(one point: the fixed part is 0) and divided by the towers' transformer size, layers x tokens x width,
summed over both towers, giving bytes per (layer · token · width unit) of a bf16 tower pass. A ViT-based
model is then estimated as that constant times its own layers x tokens x width; fp32 doubles it (every
saved tensor twice the bytes); ``--grad-checkpointing`` keeps each block's input (2 bytes a value in bf16)
plus one block's full activations. Models whose image tower is not a ViT (ResNets, timm towers) have no
such estimate: measure them on a GPU (``toolkit plan --measure``).
"""

from __future__ import annotations

from typing import Any

GiB = 1024**3
# The H100 measurement the estimate is calibrated on (module docstring).
H100_MODEL, H100_PRECISION, H100_BATCH, H100_LOSS = "ViT-B-32", "bf16", 512, "openclip"
H100_PEAK_BYTES = 11.719682216644287 * GiB  # gpu_check_h100_trainer.json, rows[1].peak_gib
H100_TEXT_TOKENS = 12  # the longest caption of the run's synthetic data (benchmarks/gpu/data.py), BPE tokens
SOURCE = (
    "estimate, no GPU here: the H100 run's measured ViT-B-32 bf16 peak (benchmarks/gpu/results/"
    "gpu_check_h100.md) scaled by layers x tokens x width; `--measure` on a GPU machine measures it"
)


def tower_units(
    model_cfg: dict[str, Any], text_tokens: int = 0, image_px: int = 0, patch_dropout: float = 0.0
) -> tuple[int, int]:
    """(layers x tokens x width summed over both towers, the largest single layer's tokens x width) of a
    ViT + text-transformer config; ``text_tokens`` 0: the full context; ``image_px`` 0: the config's side;
    ``patch_dropout``: the image tower's kept share of the patches (the class token always kept). ValueError
    for other towers."""
    vision, text = model_cfg.get("vision_cfg", {}), model_cfg.get("text_cfg", {})
    vit = isinstance(vision.get("layers"), int) and "patch_size" in vision
    if not vit or vision.get("timm_model_name"):
        raise ValueError(
            "no estimate for an image tower that is not a ViT (a ResNet or timm tower): run "
            "`toolkit plan --measure` on a machine with the GPU"
        )
    from toolkit.models.patch_dropout import kept_tokens

    side = vision["image_size"] if isinstance(vision["image_size"], int) else vision["image_size"][0]
    image_tokens = kept_tokens(((image_px or side) // vision["patch_size"]) ** 2, patch_dropout, 1)
    context = int(text.get("context_length", 77))
    tokens = min(text_tokens, context) if text_tokens else context
    image = (vision["layers"], image_tokens * int(vision["width"]))
    words = (int(text.get("layers", 12)), tokens * int(text.get("width", 512)))
    return image[0] * image[1] + words[0] * words[1], max(image[1], words[1])


def bytes_per_unit(h100_other_bytes: float) -> float:
    """Activation bytes per (layer · token · width) of a bf16 tower pass, from the H100 point;
    ``h100_other_bytes``: the planner's rows other than activations for the H100 configuration
    (``H100_*``), which the planner computes (it imports this module, not the other way round)."""
    from toolkit.models.factory import resolve_spec

    units, _ = tower_units(resolve_spec(H100_MODEL).model_cfg, H100_TEXT_TOKENS)
    return (H100_PEAK_BYTES - h100_other_bytes) / H100_BATCH / units


def activation_share(
    model_cfg: dict[str, Any],
    *,
    text_tokens: int = 0,
    image_px: int = 0,
    patch_dropout: float = 0.0,
    base_text_tokens: int = 0,
) -> float:
    """Per-sample activations of a tower pass at (``text_tokens``, ``image_px``, ``patch_dropout``) as a share
    of those at full size with ``base_text_tokens`` (0: the context), by the layers x tokens x width model
    (module docstring): how the planner scales measured full-size activations to patch dropout and to a
    stage's size without measuring again. ValueError for towers other than a ViT and a text transformer."""
    units, _ = tower_units(model_cfg, text_tokens or base_text_tokens, image_px, patch_dropout)
    return units / tower_units(model_cfg, base_text_tokens)[0]


def estimated_constants(
    model: str,
    precision: str,
    text_tokens: int,
    grad_checkpointing: bool,
    h100_other_bytes: float,
    patch_dropout: float = 0.0,
) -> tuple[float, float, float, str]:
    """(fixed, per-sample, runtime buffers, source) of a CUDA tower pass of ``model`` (module docstring) at
    ``patch_dropout`` (its image tower on the kept tokens)."""
    from toolkit.models.factory import resolve_spec

    units, widest = tower_units(resolve_spec(model).model_cfg, text_tokens, patch_dropout=patch_dropout)
    per_unit = bytes_per_unit(h100_other_bytes) * (2.0 if precision == "fp32" else 1.0)
    if grad_checkpointing:  # each block's input kept (one value per unit), one block recomputed at a time
        element = 4.0 if precision == "fp32" else 2.0
        return 0.0, units * element + widest * per_unit, 0.0, SOURCE + " (with grad checkpointing)"
    return 0.0, units * per_unit, 0.0, SOURCE
