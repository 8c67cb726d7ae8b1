"""Public entry points of the sigmoid loss: input checks, backend dispatch, autograd, ``siglip_loss``.

Every rank calls these on its own blocks (the distributed modes pass local x against gathered or
ring-passed y with ``pos_offset = rank·b``, or no positives for another rank's block).
"""

from __future__ import annotations

import torch
from torch import Tensor

from toolkit.kernels.api import resolve_backend
from toolkit.kernels.common import accumulation_dtype
from toolkit.kernels.siglip import naive, tiled
from toolkit.kernels.siglip.common import SigmoidSums


def _as_scalar(value: Tensor | float | None, name: str, like: Tensor) -> Tensor:
    """A 0-d tensor on ``like``'s device (None → 0: no bias); refuses anything but 0-d or one element."""
    if value is None:
        return torch.zeros((), dtype=torch.float32, device=like.device)
    if not isinstance(value, Tensor):
        return torch.tensor(float(value), device=like.device)
    if value.numel() != 1 or value.dim() > 1:
        raise ValueError(f"{name} must be 0-d (or one element), got shape {tuple(value.shape)}")
    if value.device != like.device:
        raise ValueError(f"{name} on {value.device} but the features on {like.device}")
    return value.reshape(())


def _check_features(x: Tensor, y: Tensor) -> None:
    if x.dim() != 2 or y.dim() != 2:
        raise ValueError(f"features must be 2-d [rows, D]; got x {tuple(x.shape)}, y {tuple(y.shape)}")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"x and y need the same feature dim D; got x {tuple(x.shape)}, y {tuple(y.shape)}")
    if x.device != y.device:
        raise ValueError(f"x on {x.device} but y on {y.device}")
    if not (x.is_floating_point() and y.is_floating_point()):
        raise TypeError(f"features must be floating point, got {x.dtype} and {y.dtype}")


def sigmoid_sums(
    x: Tensor,
    y: Tensor,
    scale: Tensor | float,
    bias: Tensor | float | None = None,
    pos_offset: int | None = 0,
    *,
    compute_dx: bool = False,
    compute_dy: bool = False,
    compute_loss: bool = True,
    backend: str = "auto",
    block_size: int | None = None,
    input_precision: str | None = None,
) -> SigmoidSums:
    """−Σ_ij log σ(z_ij (t·s_ij + b)) over x [M, D] × y [N, D] and (when asked) its gradients, no autograd.

    z_ij = +1 where j == i + ``pos_offset`` (None: no positives), −1 elsewhere; ``scale`` t (0-d, t itself),
    ``bias`` b (0-d; None = 0). Sums, not means: the caller divides. Returns ``SigmoidSums`` in fp32
    (fp64 for fp64 inputs); ``d_scale``/``d_bias`` come with either gradient side. ``compute_loss=False``
    skips the loss terms (its ``loss`` is then 0) for a sweep that only wants gradients.
    """
    _check_features(x, y)
    x, y = x.detach(), y.detach()
    acc = accumulation_dtype(x)
    t = _as_scalar(scale, "scale", x).detach().to(acc)
    b = _as_scalar(bias, "bias", x).detach().to(acc)
    which = resolve_backend(backend, x.device, x.dtype)
    if which == "naive":
        out = naive.sigmoid_sums(x, y, t, b, pos_offset, compute_dx, compute_dy)
        return out if compute_loss else out._replace(loss=torch.zeros_like(out.loss))
    if which == "torch":
        return tiled.sigmoid_sums(x, y, t, b, pos_offset, compute_dx, compute_dy, block_size, compute_loss)
    from toolkit.kernels.siglip import triton_kernel

    return triton_kernel.sigmoid_sums(
        x, y, t, b, pos_offset, compute_dx, compute_dy, block_size, input_precision, compute_loss
    )


class SigLIPLossFn(torch.autograd.Function):
    """The sigmoid loss of x against y divided by ``rows`` (the local batch), fused: when an input needs a
    gradient, the forward's single sweep also produces dx, dy, dt, db (no normaliser couples the tiles,
    so nothing has to wait for the upstream gradient) and the backward only multiplies them by it.
    Saves O((M + N)·D); never a tile."""

    @staticmethod
    def forward(ctx, x, y, scale, bias, pos_offset, rows, backend, block_size, input_precision):
        need = ctx.needs_input_grad
        scalars = (
            need[2] or need[3]
        )  # t, b: either side's sweep gives them (the x side when neither is wanted)
        out = sigmoid_sums(
            x,
            y,
            scale,
            bias,
            pos_offset,
            compute_dx=need[0] or (scalars and not need[1]),
            compute_dy=need[1],
            backend=backend,
            block_size=block_size,
            input_precision=input_precision,
        )
        ctx.grads = [
            out.dx if need[0] else None,
            out.dy,
            out.d_scale if need[2] else None,
            out.d_bias if need[3] else None,
        ]
        ctx.dtypes = (x.dtype, y.dtype, scale.dtype, bias.dtype)
        ctx.rows = rows
        return out.loss / rows

    @staticmethod
    def backward(ctx, grad):
        grads, ctx.grads = ctx.grads, None  # drop ctx's references: x.grad can take the tensors as they are
        coef = grad.to(grads[2].dtype if grads[2] is not None else grad.dtype) / ctx.rows
        out = [None if g is None else g.mul_(coef).to(dt) for g, dt in zip(grads, ctx.dtypes, strict=True)]
        return (*out, None, None, None, None, None)


def siglip_loss(
    image_features: Tensor,
    text_features: Tensor,
    scale: Tensor | float,
    bias: Tensor | float | None,
    *,
    backend: str = "auto",
    block_size: int | None = None,
    input_precision: str | None = None,
) -> Tensor:
    """open_clip's ``SigLipLoss()(image_features, text_features, scale, bias)`` on one process:
    −(1/B) Σ_i Σ_j log σ(z_ij (t·⟨x_i, y_j⟩ + b)), z_ii = +1, else −1, with ``scale`` t itself (not its log)
    and ``bias`` b (None: 0). Features [B, D] of any float dtype; returns a 0-d loss in fp32 (fp64 for fp64
    features) with gradients to features, t and b. Memory O(B·D): no B×B matrix (backend ``naive`` aside).
    """
    if image_features.shape != text_features.shape:
        raise ValueError(
            f"image_features {tuple(image_features.shape)} and text_features "
            f"{tuple(text_features.shape)} must have the same shape [B, D]"
        )
    _check_features(image_features, text_features)
    t = _as_scalar(scale, "scale", image_features)
    if resolve_backend(backend, image_features.device, image_features.dtype) == "naive":
        return naive.siglip_loss(
            image_features,
            text_features,
            t,
            None if bias is None else _as_scalar(bias, "bias", image_features),
        )
    b = _as_scalar(bias, "bias", image_features)
    if not torch.is_grad_enabled():  # no graph: the loss alone (the fused forward would also make gradients)
        return (
            sigmoid_sums(
                image_features,
                text_features,
                t,
                b,
                0,
                backend=backend,
                block_size=block_size,
                input_precision=input_precision,
            ).loss
            / image_features.shape[0]
        )
    return SigLIPLossFn.apply(
        image_features, text_features, t, b, 0, image_features.shape[0], backend, block_size, input_precision
    )
