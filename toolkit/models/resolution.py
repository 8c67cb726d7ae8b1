"""An open_clip ViT at any input resolution, and token batches shortened CLIPA's way (arXiv 2305.07017).

Images: ``allow_any_resolution(clip)`` makes the image tower accept a grid other than its own: the class
token's positional embedding is kept and the patch table [G², w] is resized bicubically to the input's grid
[g², w] in every forward (what CLIPA does once at its switch, and timm's ``dynamic_img_size`` per call).
The parameter keeps its full-resolution shape, so the optimiser state, DDP's buckets, checkpoints and the
saved open_clip model never change shape, and a stage switch is a change of input size only; at the
model's own resolution the table is used as is (the plain open_clip forward, bit for bit). At low resolution
the gradient reaches the full table through the interpolation.

Text: ``shorten_tokens`` cuts captions to k positions: the first k-1 tokens and the end-of-text token
(CLIPA's truncation), or the start token, a random ordered subset of the caption and the end-of-text token
(``random``: drawn from (seed, sample id), so a resume draws the same). A caption of at most k positions is
unchanged. The text tower then runs on k positions (``text_trim``: positional embeddings and the causal mask
are sliced).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from toolkit.models.patch_dropout import sample_noise
from toolkit.models.text_trim import pooled_positions


def resize_patch_table(table: Tensor, grid: int) -> Tensor:
    """Positional table [1 + G², w] (class token first) -> [1 + grid², w], the patches resized bicubically."""
    native = int(round((table.shape[0] - 1) ** 0.5))
    if grid == native:
        return table
    patches = table[1:].reshape(1, native, native, -1).permute(0, 3, 1, 2).float()
    patches = F.interpolate(patches, size=(grid, grid), mode="bicubic", align_corners=False)
    patches = patches.permute(0, 2, 3, 1).reshape(grid * grid, -1).to(table.dtype)
    return torch.cat([table[:1], patches], dim=0)


def _embeds(self: Any, x: Tensor) -> Tensor:
    """open_clip ``VisionTransformer._embeds`` with the positional table resized to the input's grid."""
    from open_clip.transformer import _expand_token

    x = self.conv1(x)  # [b, w, g, g]
    grid = x.shape[-1]
    x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)  # [b, g², w]
    x = torch.cat([_expand_token(self.class_embedding, x.shape[0]).to(x.dtype), x], dim=1)
    x = x + resize_patch_table(self.positional_embedding, grid).to(x.dtype)
    x = self.patch_dropout(x)
    return self.ln_pre(x)


def allow_any_resolution(clip: Any) -> None:
    """Let ``clip``'s open_clip ViT take square inputs of any multiple of its patch size (module docstring);
    refuses other image towers."""
    visual = getattr(clip, "visual", None)
    table = getattr(visual, "positional_embedding", None)
    if table is None or not hasattr(visual, "conv1") or getattr(visual, "attn_pool", None) is not None:
        raise ValueError(
            f"a low-resolution stage needs an open_clip ViT image tower with a learned positional "
            f"table; {type(visual).__name__} is not one"
        )
    visual._embeds = types.MethodType(_embeds, visual)


def resize_pixels(pixels: Tensor, size: int) -> Tensor:
    """Float pixels [b, 3, S, S] -> [b, 3, size, size] (bilinear with antialiasing when shrinking)."""
    if pixels.shape[-1] == size:
        return pixels
    return F.interpolate(pixels, size=(size, size), mode="bilinear", antialias=True, align_corners=False)


def shorten_tokens(
    tokens: Tensor,
    k: int,
    pool_type: str,
    eos_id: int | None,
    mode: str = "first",
    seed: int = 0,
    ids: Tensor | None = None,
) -> Tensor:
    """Token ids [b, L] -> [b, min(L, k)] (module docstring); ``mode`` "first" or "random" (then ``seed`` and
    the global sample ``ids`` [b] draw the subset). k >= 2 (start and end-of-text tokens)."""
    b, length = tokens.shape
    if length <= k:
        return tokens
    pooled = pooled_positions(tokens, pool_type, eos_id)  # [b]
    cols = torch.arange(k, device=tokens.device).expand(b, k).clone()
    long = pooled >= k
    if mode == "random" and k > 2:
        if ids is None:
            raise ValueError("random text shortening needs the sample ids")
        noise = sample_noise(seed, ids.to(tokens.device), length)
        position = torch.arange(length, device=tokens.device).view(1, -1)
        inside = (position >= 1) & (position < pooled.view(-1, 1))  # the caption between start and end tokens
        chosen = noise.masked_fill(~inside, -1.0).topk(k - 2, dim=1).indices.sort(dim=1).values
        cols[long, 1 : k - 1] = chosen[long]
    cols[long, k - 1] = pooled[long]
    return tokens.gather(1, cols)
