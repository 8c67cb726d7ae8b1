"""Frozen towers at their own CPU speed: the same features, computed with less work.

Every function here keeps a tower's outputs (float32, up to rounding: tests/models/test_inference.py checks
the folded channels-last trunk against a float64 forward, no further from it than 4x the eager float32
forward's error) and only changes how they are computed:

- :func:`fold_batchnorm`: a BatchNorm that follows a convolution is folded into the convolution's weight
  and bias (eval mode only: running statistics are constants then); timm's ``BatchNormAct2d`` keeps its
  activation. EfficientNet-Lite0 has 49 such pairs, each a full extra pass over its activations.
- channels-last memory format for convolutional trunks: oneDNN's depthwise and 1x1 convolutions read NHWC
  without reordering (:func:`prepare_image_trunk`).
- :func:`trimmed_tokens`: MiniLM captions are padded to 64 word pieces; attention and the feed-forward
  layers cost time per position, so each batch is cut to its longest caption (the padding is masked out of
  the mean pooling, so the features do not change).
- :data:`IMAGE_BATCH`: the batch size that runs the image trunk fastest here (see its comment).

All of it runs under ``torch.inference_mode`` in the calling process; callers pick the threads.
"""

from __future__ import annotations

import functools
from typing import Any

# Images per forward pass of a frozen convolutional trunk. EfficientNet-Lite0 at 224 px, 2 threads, one
# interleaved run of eager / channels-last / folded+channels-last / TorchScript-frozen variants (2026-11-25,
# load ~1 rising to ~10, so noisy): batch 8 ran 4.6-39 images/s (median 22), batch 32 4.5-14 (median 7.9);
# batch 8 was ahead in 7 of 8 pairs. Likely cache effects (not profiled). Re-measure on other CPUs.
IMAGE_BATCH = 8


@functools.cache
def _act_only_class() -> type:
    import torch

    class FoldedBatchNorm(torch.nn.Module):
        """What is left of a BatchNorm folded into the conv before it: (BatchNormAct2d's) dropout and
        activation, or nothing for a plain BatchNorm2d."""

        def __init__(self, drop: Any, act: Any):
            super().__init__()
            self.drop, self.act = drop, act

        def forward(self, x):
            return self.act(self.drop(x))

    return FoldedBatchNorm


def _act_only(bn: Any) -> Any:
    import torch

    identity = torch.nn.Identity
    return _act_only_class()(getattr(bn, "drop", None) or identity(), getattr(bn, "act", None) or identity())


def _fold_pair(conv: Any, bn: Any) -> None:
    """conv(x) then bn(.) in eval mode == conv'(x) with w' = w * g / s, b' = (b - mu) * g / s + beta."""
    import torch

    with torch.no_grad():
        scale = (
            bn.weight / torch.sqrt(bn.running_var + bn.eps)
            if bn.affine
            else 1 / torch.sqrt(bn.running_var + bn.eps)
        )
        shift = bn.bias if bn.affine else torch.zeros_like(bn.running_mean)
        bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
        conv.weight.copy_(conv.weight * scale.view(-1, 1, 1, 1))
        new_bias = (bias - bn.running_mean) * scale + shift
        if conv.bias is None:
            conv.bias = torch.nn.Parameter(new_bias, requires_grad=False)
        else:
            conv.bias.copy_(new_bias)


def fold_batchnorm(module: Any) -> int:
    """Fold every BatchNorm2d that directly follows a Conv2d among its parent's children (registration
    order, which is the forward order in timm's EfficientNet/MobileNet/ResNet blocks) into that conv, in
    place; the module must be in eval mode (running statistics). Returns the number of folded pairs."""
    import torch

    if module.training:
        raise ValueError(
            "fold_batchnorm: the module is in training mode; BatchNorm uses batch statistics "
            "there and cannot be folded (call .eval() first)"
        )
    folded = 0
    for parent in list(module.modules()):
        names = list(parent._modules)
        for prev, name in zip(names, names[1:], strict=False):
            conv, bn = parent._modules[prev], parent._modules[name]
            if (
                isinstance(conv, torch.nn.Conv2d)
                and isinstance(bn, torch.nn.BatchNorm2d)
                and bn.track_running_stats
                and bn.running_var is not None
                and conv.out_channels == bn.num_features
            ):
                _fold_pair(conv, bn)
                parent._modules[name] = _act_only(bn)
                folded += 1
    return folded


def prepare_image_trunk(trunk: Any) -> Any:
    """A frozen convolutional trunk made ready for fast CPU inference, in place: eval mode, no grads,
    BatchNorms folded, channels-last weights. Returns the trunk. Inputs should be channels-last too
    (:func:`to_channels_last`)."""
    import torch

    trunk.eval().requires_grad_(False)
    fold_batchnorm(trunk)
    return trunk.to(memory_format=torch.channels_last)


def to_channels_last(images: Any) -> Any:
    """NCHW float images [n, 3, S, S] in channels-last memory layout (same shape and values)."""
    import torch

    return images.contiguous(memory_format=torch.channels_last)


def trimmed_tokens(tokens: Any, pad_id: int) -> Any:
    """token ids [n, L] (right-padded with ``pad_id``) -> [n, L'] with L' the longest caption of the batch.
    A transformer with an attention mask over the padding gives the same pooled features."""
    lengths = (tokens != pad_id).sum(dim=1)
    longest = max(int(lengths.max()) if tokens.shape[0] else 1, 1)
    return tokens[:, :longest]


def is_conv_trunk(trunk: Any) -> bool:
    """Does ``trunk`` hold BatchNorm2d layers (a convolutional net that folding and channels-last help)?"""
    import torch

    return any(isinstance(m, torch.nn.BatchNorm2d) for m in trunk.modules())


def optimize_clip(model: Any) -> dict[str, Any]:
    """Speed up an open_clip model's frozen-tower parts for evaluation, in place (eval mode assumed):
    a timm trunk (``model.visual.trunk``) gets :func:`prepare_image_trunk` and channels-last inputs; an
    HF text tower (``model.text``) gets its batches trimmed to their longest caption. Other towers are left
    alone. Returns what was done, for the stage's record."""
    done: dict[str, Any] = {}
    visual = getattr(model, "visual", None)
    trunk = getattr(visual, "trunk", None)
    if trunk is not None and is_conv_trunk(trunk) and not getattr(visual, "_cliptk_fast", False):
        import torch

        trunk.eval()
        done["folded_batchnorms"] = fold_batchnorm(trunk)
        trunk.to(memory_format=torch.channels_last)
        visual.register_forward_pre_hook(lambda _m, args: (to_channels_last(args[0]), *args[1:]))
        visual._cliptk_fast = True
        done["channels_last"] = True
    text = getattr(model, "text", None)
    config = getattr(text, "config", None)
    if (
        config is not None
        and getattr(config, "pad_token_id", None) is not None
        and not getattr(text, "_cliptk_fast", False)
    ):
        pad = int(config.pad_token_id)
        text.register_forward_pre_hook(lambda _m, args: (trimmed_tokens(args[0], pad), *args[1:]))
        text._cliptk_fast = True
        done["trimmed_padding"] = True
    return done
