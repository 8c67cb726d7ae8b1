"""The text tower on the positions that count: a batch of token ids cut after its last pooled position.

open_clip's CLIP text transformer is causal (its ``attn_mask`` lets position p attend to positions <= p
only) and pools one position per caption: the end-of-text token (``text_pool_type`` "argmax": the highest
id, or "eos": the first ``text_eos_id``). So the pooled feature of a caption, and every gradient that
flows back from it, depends on positions up to the pooled one and on nothing after it: a batch can drop
every column after the largest pooled position of its rows and the features and gradients are the same
(positional embeddings and the mask are sliced to the kept length). Captions are often short next to
the context (the demo's emoji names: 5 tokens on average, 13 at most, of cliptk-tiny's 32); attention
and the feed-forward layers cost time per position, attention per position pair. What is saved depends
on the longest caption of each batch, never on the average. tests/models/test_text_trim.py checks values and
gradients against open_clip's ``encode_text`` in float64.

- :func:`trimmable`: whether a model is such a causal, single-position-pooling CLIP (else nothing is cut).
- :func:`trim_tokens`: a host batch [b, L] -> its first L' columns (a view; no copy, no device sync).
- :func:`encode_text`: open_clip's ``CLIP.encode_text`` for token ids of any length L' <= the context.
"""

from __future__ import annotations

from typing import Any

from torch import nn

POOLED_ONE_POSITION = ("argmax", "eos")


def trimmable(clip: Any) -> bool:
    """True for an open_clip ``CLIP`` whose text transformer is causal and pools one position per caption
    (``CustomTextCLIP`` with an HF text tower, non-causal masks and "first"/"last" pooling are not)."""
    from open_clip.model import CLIP

    return (
        type(clip) is CLIP
        and clip.attn_mask is not None
        and clip.text_pool_type in POOLED_ONE_POSITION
        and (clip.text_pool_type != "eos" or clip.text_eos_id is not None)
    )


def pooled_positions(tokens: Any, pool_type: str, eos_id: int | None) -> Any:
    """The position each caption is pooled at, [b] (open_clip's ``text_global_pool``)."""
    if pool_type == "argmax":
        return tokens.argmax(dim=-1)
    return (tokens == eos_id).int().argmax(dim=-1)


def trim_tokens(tokens: Any, pool_type: str, eos_id: int | None) -> Any:
    """``tokens`` [b, L] (int, host or device) cut to [b, L'] with L' = 1 + the largest pooled position.
    Called on the host copy of a batch, before it moves to the device, so the cut costs no device sync."""
    if tokens.shape[0] == 0:
        return tokens
    length = int(pooled_positions(tokens, pool_type, eos_id).max()) + 1
    return tokens[:, :length]


def encode_text(clip: Any, text: Any) -> Any:
    """``clip.encode_text(text)`` (unnormalised, [b, E]) for ``text`` [b, L'] with L' <= the context length:
    the positional embeddings and the causal mask are cut to L'. ``clip`` must be :func:`trimmable`."""
    from open_clip.transformer import text_global_pool

    length = text.shape[1]
    cast_dtype = clip.transformer.get_cast_dtype()
    x = clip.token_embedding(text).to(cast_dtype)
    x = x + clip.positional_embedding[:length].to(cast_dtype)
    x = clip.transformer(x, attn_mask=clip.attn_mask[:length, :length])
    x = clip.ln_final(x)
    x = text_global_pool(x, text, clip.text_pool_type, eos_token_id=clip.text_eos_id)
    if clip.text_projection is None:
        return x
    if isinstance(clip.text_projection, nn.Linear):
        return clip.text_projection(x)
    return x @ clip.text_projection
