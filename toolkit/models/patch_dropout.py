"""Patch dropout (FLIP, arXiv 2212.00794) with masks that are a function of (step seed, sample id).

During training each image keeps a random ``k = max(1, int(n · (1 - P)))`` of its n patch tokens (the class
token always stays); the transformer then runs on k + 1 tokens instead of n + 1. At evaluation (``eval()``)
the module is the identity.

Why not open_clip's ``PatchDropout``: it draws ``torch.randn(batch, n)`` from the global generator per call,
so the mask of a sample depends on its position in the micro-batch and on the generator's state (the rank
and micro-batch the trainer seeded). Two ranks, a different micro-batch size or a resume would then train
on other masks than one process does, and no seeding of the global generator can fix that: the draw is one
block for the whole micro-batch. Here every sample's noise is a hash of (the step's seed, its global id,
the patch index) — the selection FLIP describes, keep the top-k of per-patch noise — so the gradient
cache's two passes, any world size and any resume see the same masks, with no generator state to save.
The hash runs on the tensors' device (integer ops), so no host round trip on CUDA.

The trainer names the step's keys around every forward (``keyed``); a training-mode forward without
keys is an error rather than an unseeded draw. The module has no parameters or buffers: the state dict
and the saved open_clip model are unchanged (open_clip's ``vision_cfg.patch_dropout`` is not written).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from toolkit.core.seeds import GAMMA, MASK64, MUL1, MUL2

_TAG = 0x5BD1E9955BD1E995  # separates this stream from other uses of the step seed


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 torch holds it (two's complement)."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shr(v: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 ``v`` (torch's ``>>`` is arithmetic)."""
    return (v >> bits) & ((1 << (64 - bits)) - 1)


def _mix(v: Tensor) -> Tensor:
    """splitmix64's step and finaliser (core.seeds' constants) on int64 tensors on their own device
    (multiplication wraps modulo 2^64, as in C); core.seeds.splitmix64 is the numpy one."""
    v = v + _signed(GAMMA)
    v = (v ^ _shr(v, 30)) * _signed(MUL1)
    v = (v ^ _shr(v, 27)) * _signed(MUL2)
    return v ^ _shr(v, 31)


def sample_noise(seed: int, ids: Tensor, n: int) -> Tensor:
    """Uniform noise [b, n] in [0, 1), float64, a hash of (seed, ids[r], column): no generator state."""
    sample = _mix(ids.to(torch.int64).view(-1, 1) ^ _signed(seed ^ _TAG))  # [b, 1]
    column = torch.arange(n, device=ids.device, dtype=torch.int64).view(1, -1) * _signed(GAMMA)
    return _shr(_mix(sample + column), 11).to(torch.float64) * 2.0**-53  # 53 bits: exact, no ties in practice


def keep_indices(seed: int, ids: Tensor, num_patches: int, prob: float) -> Tensor:
    """Sorted indices [b, k] of the patches each sample keeps, k = max(1, int(n·(1-prob))): the top k of
    per-patch noise hash(seed, id, patch). ``ids``: global sample ids [b] (any integer dtype, any device)."""
    k = max(1, int(num_patches * (1.0 - prob)))
    return sample_noise(seed, ids, num_patches).topk(k, dim=1).indices.sort(dim=1).values


class SeededPatchDropout(nn.Module):
    """Drop-in for open_clip's ``visual.patch_dropout`` (module docstring). ``num_prefix``: leading tokens
    always kept (1: the class token; 0 for a tower without one). Input and output [b, prefix + n, w]."""

    def __init__(self, prob: float, num_prefix: int = 1):
        super().__init__()
        if not 0.0 <= prob < 1.0:
            raise ValueError(f"patch_dropout must be in [0, 1), got {prob}")
        self.prob, self.num_prefix = float(prob), int(num_prefix)
        self.keys: tuple[int, Tensor] | None = None  # (step seed, ids [b]) set by ``keyed``

    def extra_repr(self) -> str:
        return f"prob={self.prob}, num_prefix={self.num_prefix}"

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.prob == 0.0:
            return x
        if self.keys is None:
            raise RuntimeError(
                "patch dropout in training needs the step's keys: run the forward inside "
                "toolkit.models.patch_dropout.keyed(model, seed, sample_ids)"
            )
        seed, ids = self.keys
        if ids.shape[0] != x.shape[0]:
            raise RuntimeError(f"patch dropout: {ids.shape[0]} sample ids for a batch of {x.shape[0]}")
        prefix, patches = x[:, : self.num_prefix], x[:, self.num_prefix :]
        keep = keep_indices(seed, ids.to(x.device), patches.shape[1], self.prob)
        kept = patches.gather(1, keep.unsqueeze(-1).expand(-1, -1, patches.shape[2]))
        return torch.cat((prefix, kept), dim=1)


def install(clip: nn.Module, prob: float) -> SeededPatchDropout:
    """Replace ``clip.visual.patch_dropout`` (open_clip's ViT) by a ``SeededPatchDropout(prob)``, in place;
    refuses a model whose image tower has none (ResNets, timm towers)."""
    visual = getattr(clip, "visual", None)
    if visual is None or not hasattr(visual, "patch_dropout"):
        raise ValueError(
            f"patch_dropout: the image tower of {type(clip).__name__} "
            f"({type(visual).__name__}) has no patch tokens to drop (open_clip ViTs only)"
        )
    num_prefix = 0 if getattr(visual, "class_embedding", None) is None else 1
    module = SeededPatchDropout(prob, num_prefix)
    visual.patch_dropout = module
    return module


def kept_tokens(num_patches: int, prob: float, num_prefix: int = 1) -> int:
    """Tokens the image transformer runs on with patch dropout ``prob`` (training)."""
    return num_prefix + (num_patches if prob == 0 else max(1, int(num_patches * (1.0 - prob))))


@contextlib.contextmanager
def keyed(model: nn.Module, seed: int | None, ids: Tensor) -> Iterator[None]:
    """Within the block, every ``SeededPatchDropout`` of ``model`` (DDP-wrapped or not) masks sample r of
    its batch from (``seed``, ``ids[r]``); ``seed`` None sets nothing (a model without patch dropout)."""
    modules = [m for m in model.modules() if isinstance(m, SeededPatchDropout)] if seed is not None else []
    for m in modules:
        m.keys = (seed, ids)
    try:
        yield
    finally:
        for m in modules:
            m.keys = None
