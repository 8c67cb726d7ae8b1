"""What FastCLIP builds on: the contrastive LSE kernels, the counted no-grad all_gather, and an
autograd node that hands back gradients computed eagerly in the forward pass."""

from __future__ import annotations

import torch
from torch import Tensor

from toolkit.core import dist as cdist
from toolkit.kernels import lse_backward as _lse_backward
from toolkit.kernels import lse_forward as _lse_forward


def lse_forward(x: Tensor, y: Tensor, row_scale: Tensor, col_scale: Tensor, diag_offset: int | None,
                compute_row: bool, compute_col: bool, backend: str) -> tuple[Tensor | None, Tensor | None]:
    """``toolkit.kernels.lse_forward`` (see its docstring)."""
    return _lse_forward(x, y, row_scale, col_scale, diag_offset=diag_offset, compute_row=compute_row,
                        compute_col=compute_col, backend=backend)


def lse_backward(x: Tensor, y: Tensor, row_scale: Tensor, col_scale: Tensor, row_lse: Tensor | None,
                 col_lse: Tensor | None, grad_row: Tensor | None, grad_col: Tensor | None,
                 diag_offset: int | None, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``toolkit.kernels.lse_backward``: the LSEs may be any normalisers (FastCLIP passes
    a·s_ii + log(B−1) + log(u_i+ε), so that P_ij = exp(a(s_ij−s_ii)) / ((B−1)(u_i+ε)))."""
    return _lse_backward(x, y, row_scale, col_scale, row_lse, col_lse, grad_row, grad_col,
                         diag_offset=diag_offset, backend=backend)


def world(group=None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) without an initialised process group."""
    return cdist.get_rank(group), cdist.get_world_size(group)


def all_gather_nograd(t: Tensor, group=None, category: str = "features", check_sizes: bool = False) -> Tensor:
    """[b, ...] from every rank of ``group`` -> [K·b, ...] in rank order, without autograd; counted in
    the communication ledger. Called by all ranks; ``check_sizes`` refuses unequal batches with an
    error naming each rank's shape (the first gather of a step checks, later ones reuse that)."""
    return cdist.all_gather_nograd(t.contiguous(), group=group, category=category, check_sizes=check_sizes)


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
