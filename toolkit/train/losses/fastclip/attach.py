"""The autograd node FastCLIP hands its eagerly computed gradients to (``attach``).

FastCLIP's gradients are formed in the forward pass, not by differentiating the value it returns.
"""

from __future__ import annotations

import torch
from torch import Tensor


class AttachGrads(torch.autograd.Function):
    """Returns ``value`` (0-d); backward gives each input its precomputed gradient × grad_output.

    FastCLIP's gradients are not the gradient of the value it reports (u is held fixed, the reference
    counts the τ term twice, v2 mixes pre- and post-update τ), so they are formed in forward and
    attached here. Inputs: value, then pairs (tensor, its gradient or None).
    """

    @staticmethod
    def forward(ctx, value: Tensor, *pairs: Tensor | None) -> Tensor:
        inputs, grads = pairs[0::2], pairs[1::2]
        ctx.shapes = [(t.shape, t.dtype) if t is not None else None for t in inputs]
        ctx.has = [g is not None for g in grads]
        ctx.save_for_backward(*[g for g in grads if g is not None])
        return value.detach().clone()

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        saved = iter(ctx.saved_tensors)
        out: list[Tensor | None] = [None]
        for meta, has in zip(ctx.shapes, ctx.has, strict=True):
            if has and meta is not None:
                g = next(saved)
                out += [(grad_out.to(g.dtype) * g).reshape(meta[0]).to(meta[1]), None]
            else:
                out += [None, None]
        return tuple(out)


def attach(value: Tensor, pairs: list[tuple[Tensor, Tensor | None]]) -> Tensor:
    """``value`` carrying the given gradients for each (input tensor, gradient) pair."""
    flat: list[Tensor | None] = []
    for t, g in pairs:
        flat += [t, g]
    return AttachGrads.apply(value, *flat)
