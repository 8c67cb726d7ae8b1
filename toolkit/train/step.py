"""One optimiser step on this rank's slice of a global batch, with an optional gradient cache.

Without micro-batches (``micro_batch_size`` 0 or >= the local batch b): one forward with a graph, the
loss, one backward. With micro-batches of m < b (the gradient cache, GradCache-style):

1. every micro-batch runs forward **without** a graph; only its features [m, E] are kept;
2. the loss runs once on the whole local batch's features (all ranks together form the global batch)
   and its backward gives d loss / d features [b, E] (and d loss / d a) — FastCLIP's tables are
   updated exactly once, by this one loss evaluation;
3. every micro-batch runs forward again **with** a graph and back-propagates its slice of the cached
   feature gradients; DDP all-reduces only on the last one (``grad_sync``), which also carries d a.

The random state is replayed: before both forwards of micro-batch i the generators are seeded from
(seed, step, rank, i), so dropout and drop-path draw the same masks twice and the result is the
gradient of the whole global batch, not an average of micro-batch losses. BatchNorm buffers are
restored after the graph-free pass so running statistics move once per micro-batch, as without the
cache. Every rank calls every function here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from toolkit.models.patch_dropout import keyed
from toolkit.train.ddp import grad_sync

if TYPE_CHECKING:
    from toolkit.train.losses.base import TrainingLoss


@dataclass
class StepInputs:
    """This rank's slice of one global batch: image [b, ...], text [b, ...] (on the host when offloaded:
    pinned on CUDA), sample ids [b] (on the device), and for an objective that reads them
    (``reads_reference``) a reference model's (ref_image [b, d_ref], ref_text [b, d_ref]) on the device.
    ``patch_seed``: the step's seed of the patch-dropout masks (equal on every rank; each sample's mask
    follows from it and its id)."""

    image: Tensor
    text: Tensor
    index: Tensor
    reference: tuple[Tensor, Tensor] | None = None
    patch_seed: int | None = None


class _Mover:
    """Micro-batch i of the inputs on ``device``: a plain slice when they are there already; from pinned
    host memory, on CUDA, copied on a side stream one micro-batch ahead, so the copy of i+1 overlaps the
    compute of i (data offload: only the micro-batch in flight is on the device)."""

    def __init__(self, inputs: StepInputs, ranges: list[tuple[int, int]], device: torch.device):
        self.inputs, self.ranges, self.device = inputs, ranges, device
        self.stream = (
            torch.cuda.Stream(device) if device.type == "cuda" and inputs.image.device.type == "cpu" else None
        )
        self.pending: dict[int, tuple[Tensor, Tensor]] = {}

    def _copy(self, i: int) -> tuple[Tensor, Tensor]:
        start, stop = self.ranges[i]
        parts = (self.inputs.image[start:stop], self.inputs.text[start:stop])
        if self.stream is None:
            return tuple(t.to(self.device) for t in parts)
        with torch.cuda.stream(self.stream):
            return tuple(t.to(self.device, non_blocking=True) for t in parts)

    def get(self, i: int) -> tuple[Tensor, Tensor]:
        chunk = self.pending.pop(i) if i in self.pending else self._copy(i)
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            for t in chunk:
                t.record_stream(current)  # the copy stream must not reuse the memory while compute reads it
            if i + 1 < len(self.ranges):
                self.pending[i + 1] = self._copy(i + 1)
        return chunk

    def masks(self, model: nn.Module, i: int) -> contextlib.AbstractContextManager:
        """The patch-dropout keys of micro-batch i (models/patch_dropout.py): same masks in both passes."""
        start, stop = self.ranges[i]
        return keyed(model, self.inputs.patch_seed, self.inputs.index[start:stop])


@contextlib.contextmanager
def _frozen_norm_buffers(model: nn.Module) -> Iterator[None]:
    """Restore BatchNorm running statistics after the block (the graph-free pass of the cache)."""
    norms = [
        m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]
    saved = [{k: v.clone() for k, v in m.state_dict().items()} for m in norms]
    try:
        yield
    finally:
        for m, state in zip(norms, saved, strict=True):
            m.load_state_dict(state)


def _ranges(b: int, micro: int) -> list[tuple[int, int]]:
    m = b if micro <= 0 or micro >= b else micro
    return [(s, min(s + m, b)) for s in range(0, b, m)]


def _cached_features(
    model: nn.Module,
    mover: _Mover,
    ranges: list[tuple[int, int]],
    seed_of: Callable[[int], int],
    autocast: Callable,
    offload: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Pass 1 of the cache: every micro-batch's features, written into [b, E] buffers allocated once at
    the first micro-batch (no list of chunks and concatenated copy alive together); in pinned host
    memory when ``offload`` on CUDA (the caller moves them back for the loss). Returns (x, y, the
    model's scalars (a, and the bias b of sigmoid models) of the last micro-batch)."""
    device, b = mover.device, ranges[-1][1]
    x_all = y_all = None
    with torch.no_grad(), _frozen_norm_buffers(model), autocast():
        for i, (start, stop) in enumerate(ranges):
            torch.manual_seed(seed_of(i))
            with mover.masks(model, i):
                out = model(*mover.get(i))
            x, y, scalars = out.image_features, out.text_features, out.scalars()
            if x_all is None:
                host = offload and device.type == "cuda"
                x_all, y_all = (
                    torch.empty(
                        (b, *t.shape[1:]), dtype=t.dtype, device="cpu" if host else t.device, pin_memory=host
                    )
                    for t in (x, y)
                )
            x_all[start:stop].copy_(x, non_blocking=True)
            y_all[start:stop].copy_(y, non_blocking=True)
    if x_all.device != device:
        torch.cuda.current_stream(device).synchronize()  # the device-to-host copies above have landed
    return x_all, y_all, scalars


def _loss(
    loss_fn: TrainingLoss, x: Tensor, y: Tensor, scalars: list[Tensor], inputs: StepInputs, poison: bool
) -> Tensor:
    """The objective on (x, y, ``scalars``: ``Towers.scalars()``, [a] or [a, bias]) and the batch's ids (and
    reference embeddings, for an objective that ``reads_reference``: the whole local batch's rows, as x and
    y); ``poison`` multiplies x by NaN first (module docstring)."""
    bias = scalars[1] if len(scalars) > 1 else None
    # an objective that reads the reference refuses a missing one itself
    extra = {"reference": inputs.reference} if loss_fn.reads_reference else {}
    return loss_fn(x * float("nan") if poison else x, y, scalars[0], inputs.index, logit_bias=bias, **extra)


def forward_backward(
    model: nn.Module,
    loss_fn: TrainingLoss,
    inputs: StepInputs,
    *,
    micro_batch_size: int,
    seed_of: Callable[[int], int],
    autocast: Callable,
    scale: Callable[[Tensor], Tensor] = lambda t: t,
    poison: bool = False,
    offload_features: bool = False,
) -> Tensor:
    """Gradients of this rank's share of the global objective into the parameters; returns the share
    (0-d, unscaled, detached). ``seed_of(i)`` seeds micro-batch i (``core.seeds.stream_seed``); ``autocast``
    is a context-manager factory; ``scale`` multiplies what is back-propagated (a GradScaler's ``scale``:
    equal on every rank, as the fastclip mode requires); ``poison`` multiplies the image features by NaN
    before the loss (the test aid for a model that produced a NaN: the loss, its per-sample updates and every
    gradient become non-finite). ``offload_features``: keep the cached features in host memory while the
    towers run (they come back to the device for the loss)."""
    device = inputs.index.device
    ranges = _ranges(inputs.index.shape[0], micro_batch_size)
    mover = _Mover(inputs, ranges, device)
    if len(ranges) == 1:
        torch.manual_seed(seed_of(0))
        with autocast(), mover.masks(model, 0):
            out = model(*mover.get(0))
        x, y, scalars = out.image_features, out.text_features, out.scalars()
        share = _loss(loss_fn, x, y, scalars, inputs, poison)
        scale(share).backward()
        return share.detach()
    x_all, y_all, scalars = _cached_features(model, mover, ranges, seed_of, autocast, offload_features)
    x_all, y_all = x_all.to(device).requires_grad_(), y_all.to(device).requires_grad_()
    leaves = [t.detach().requires_grad_() for t in scalars]
    share = _loss(loss_fn, x_all, y_all, leaves, inputs, poison)
    scale(share).backward()
    dx, dy = x_all.grad, y_all.grad
    del x_all, y_all  # pass 3 needs only the gradients
    # a learnable scale (and bias) always takes part in the synced backward (a zero gradient if the objective
    # gives it none): DDP all-reduces a bucket only once all its parameters reported, and would silently skip
    # it
    d_scalars = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
    for i, (start, stop) in enumerate(ranges):
        last = i == len(ranges) - 1
        with grad_sync(model, enabled=last):
            torch.manual_seed(seed_of(i))
            with autocast(), mover.masks(model, i):
                out = model(*mover.get(i))
            x, y, scalars = out.image_features, out.text_features, out.scalars()
            outputs, grads = [x, y], [dx[start:stop], dy[start:stop]]
            for t, g in zip(scalars, d_scalars, strict=True):
                if last and t.requires_grad:  # d a (and d bias) once, on the synced pass
                    outputs.append(t)
                    grads.append(g.to(t.dtype))
            torch.autograd.backward(outputs, grads)
    return share.detach()
