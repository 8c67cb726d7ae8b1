"""Tower FLOPs per sample counted from an open_clip model config (ViT image tower, transformer text tower).

Only matrix products are counted (a multiply-add = 2 FLOPs), as ``torch.utils.flop_counter.FlopCounterMode``
does; LayerNorm, GELU and softmax are a few percent at these widths and neither side counts them. One
transformer layer over n tokens of width w with MLP ratio r:

    2·n·(4 + 2r)·w²   (qkv, output projection, MLP: 2·params·tokens)   +   4·n²·w   (q·kᵀ and attention·v)

plus the image tower's patch embedding 2·(S/p)²·3p²·w (it runs before patch dropout, on every patch) and each
tower's output projection 2·w·E on its pooled token. The text tower's attention is counted over the full
n² although it is causal: the fused attention kernels compute (and FlopCounterMode counts) the full square.
A training step runs forward + backward = 3 × forward (the backward computes two products per forward
product), less the patch embedding's input gradient (pixels need none); the gradient cache adds one more
forward (``step_flops``). On the CPU, FlopCounterMode counts attention only on the math backend of
``scaled_dot_product_attention`` (the fused CPU kernel has no formula registered): the test runs it there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TowerFlops:
    """Forward FLOPs of one sample through each tower."""

    image: float  # the patch embedding included
    text: float
    patch_embed: float  # of ``image``: the convolution whose input (pixels) needs no gradient

    @property
    def total(self) -> float:
        return self.image + self.text


def _layers(n: int, width: int, layers: int, mlp_ratio: float) -> float:
    mlp = int(width * mlp_ratio)  # open_clip: int(width * mlp_ratio) hidden units
    return layers * (2.0 * n * (4 * width * width + 2 * width * mlp) + 4.0 * n * n * width)


def _vit(
    cfg: dict[str, Any], embed_dim: int, image_size: int | None, patch_dropout: float
) -> tuple[float, float]:
    from toolkit.models.patch_dropout import kept_tokens

    layers, width = cfg.get("layers", 12), cfg.get("width", 768)
    if not isinstance(layers, int) or cfg.get("timm_model_name"):
        raise ValueError(
            "FLOPs are counted for open_clip ViT image towers only (this one is a ResNet or timm model)"
        )
    size = image_size or cfg.get("image_size", 224)
    size = size[0] if isinstance(size, (list, tuple)) else size
    patch = cfg.get("patch_size", 16)
    grid = (size // patch) ** 2
    if cfg.get("attentional_pool"):
        raise ValueError("FLOPs are not counted for an attentional pooler (CoCa-style image towers)")
    n = kept_tokens(grid, patch_dropout, 1)  # open_clip's ViT always has its class token
    embed = 2.0 * grid * 3 * patch * patch * width
    return embed + _layers(n, width, layers, cfg.get("mlp_ratio", 4.0)) + 2.0 * width * embed_dim, embed


def _text(cfg: dict[str, Any], embed_dim: int, text_tokens: int | None) -> float:
    if cfg.get("hf_model_name"):
        raise ValueError(
            "FLOPs are counted for open_clip's own text transformer only (this one is Hugging Face's)"
        )
    n = text_tokens or cfg.get("context_length", 77)
    width = cfg.get("width", 512)
    return _layers(n, width, cfg.get("layers", 12), cfg.get("mlp_ratio", 4.0)) + 2.0 * width * embed_dim


def tower_flops(
    model_cfg: dict[str, Any],
    *,
    image_size: int | None = None,
    text_tokens: int | None = None,
    patch_dropout: float = 0.0,
) -> TowerFlops:
    """Forward FLOPs per sample of ``model_cfg``'s towers at ``image_size`` px (None: the config's),
    ``text_tokens`` positions (None: the context length) and ``patch_dropout`` (module docstring)."""
    embed_dim = int(model_cfg["embed_dim"])
    image, embed = _vit(model_cfg.get("vision_cfg", {}), embed_dim, image_size, patch_dropout)
    return TowerFlops(image, _text(model_cfg.get("text_cfg", {}), embed_dim, text_tokens), embed)


def step_flops(per_sample: TowerFlops, batch_size: int, gradient_cache: bool = False) -> float:
    """FLOPs of one training step's towers over ``batch_size`` samples: forward + backward (3 forwards less
    the patch embedding's input gradient), one forward more with the gradient cache's graph-free pass."""
    forwards = 4.0 if gradient_cache else 3.0
    return batch_size * (forwards * per_sample.total - per_sample.patch_embed)
