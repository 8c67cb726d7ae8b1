"""DDP wrapping with counted gradient all_reduces (fp32 or bf16) and gradient accumulation without sync.

Parameter gradients are averaged by DDP in buckets (``bucket_cap_mb``) overlapped with the backward. The
comm hooks here replace DDP's built-in all_reduce so every bucket is recorded in the ledger
(op ``all_reduce``, category ``param_grads``) at the bytes actually sent: fp32 buckets at 4 bytes per
element, bf16 buckets (``grad_dtype="bf16"``: cast, divide by K, all_reduce, cast back) at 2.
Not recorded: DDP's one-time broadcast of the module state (parameters and buffers) at construction.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from toolkit.core import dist as D

GRAD_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


@dataclass
class _HookState:
    group: object
    world_size: int
    dtype: torch.dtype | None  # None: all_reduce in the bucket's own dtype
    ledger: D.CommLedger | None


def _allreduce_hook(state: _HookState, bucket):  # no annotations: DDP checks them literally
    """Mean of the bucket over ranks; in ``state.dtype`` on the wire when set (divide first: no overflow)."""
    buf = bucket.buffer()
    if state.dtype is None or buf.dtype == state.dtype:
        return D.all_reduce_future(buf.div_(state.world_size), state.group, D.PARAM_GRADS, state.ledger)
    wire = buf.to(state.dtype).div_(state.world_size)

    def back(fut: torch.futures.Future) -> torch.Tensor:
        return buf.copy_(fut.value())

    return D.all_reduce_future(wire, state.group, D.PARAM_GRADS, state.ledger).then(back)


def wrap_ddp(
    module: nn.Module,
    *,
    grad_dtype: str = "fp32",
    bucket_cap_mb: float = 25.0,
    group=None,
    device_ids: list[int] | None = None,
    find_unused_parameters: bool = False,
    ledger: D.CommLedger | None = None,
) -> nn.Module:
    """``module`` wrapped in DDP with the counted all_reduce hook; ``module`` itself at world size 1.

    Called by every rank after ``init_from_env`` with the module on its device. ``grad_dtype``: "fp32"
    (the bucket's dtype) or "bf16" (halves the bytes; the average is rounded to bf16). Buffers are not
    re-broadcast every forward (only at construction): CLIP towers have none that change
    (open_clip's attention mask is constant), and each broadcast would be uncounted traffic.
    """
    if grad_dtype not in GRAD_DTYPES:
        raise ValueError(
            f"unknown gradient all_reduce dtype {grad_dtype!r}; choose one of {tuple(GRAD_DTYPES)}"
        )
    k = D.get_world_size(group)
    if k == 1:
        return module
    # torch >= 2.14 renamed broadcast_buffers to forward_sync_buffers (the init sync stays in both).
    no_buffer_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        else {"broadcast_buffers": False}
    )
    ddp = DistributedDataParallel(
        module,
        device_ids=device_ids,
        process_group=group,
        bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=find_unused_parameters,
        **no_buffer_sync,
    )
    ddp.register_comm_hook(_HookState(group, k, GRAD_DTYPES[grad_dtype], ledger), _allreduce_hook)
    return ddp


@contextmanager
def grad_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Run forward+backward of one micro-step; with ``enabled=False`` DDP keeps the gradients local
    (no all_reduce: accumulation micro-steps) and the next synced backward averages the sum.

    Usage: ``with grad_sync(model, enabled=(micro + 1 == num_micro)): loss.backward()`` — the forward
    must be inside the block too, as DDP decides at forward time. No-op for a plain module. An FSDP2 module
    (``train/fsdp.py``) accumulates its unsharded gradients instead of reduce-scattering them.
    """
    from torch.distributed.fsdp import FSDPModule

    if not enabled and isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
    elif enabled or not isinstance(module, DistributedDataParallel):
        yield
    else:
        with module.no_sync():
            yield
