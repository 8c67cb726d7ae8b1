"""Where this rank runs: ``Runtime.start(cfg.launch, cfg.device)`` joins the process group and picks the
device.

The first part the loop builds (every rank, collective): rank, world size, device, and the autocast
context for the run's precision. Nothing here knows about data, models or objectives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from toolkit.core import dist as D
from toolkit.core.launch import LaunchConfig
from toolkit.train.hostmem import release_freed_memory


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; refuses cuda without CUDA and unknown names."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} requested but CUDA is not available")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; expected auto, cpu or cuda")
    return torch.device(device)


def autocast(precision: str, device_type: str) -> Callable[[], Any]:
    """A factory of the autocast context for ``precision`` (fp32: a no-op context) on ``device_type``."""
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return lambda: torch.autocast(device_type, dtype=dtype)


@dataclass(frozen=True)
class Runtime:
    """This process's place in the job (``start`` builds it; every rank calls it)."""

    rank: int
    world_size: int
    local_world_size: int
    device: torch.device

    @classmethod
    def start(cls, launch: LaunchConfig, device: str = "auto", release_memory: bool = False) -> Runtime:
        """Join the process group from torchrun's / SLURM's variables (one process: a group of one;
        ``launch``: its backend and timeout) and pick the device (a rank's CUDA device when launched on GPUs,
        else ``device``); ``release_memory``: the config's ``release_freed_memory``. Collective."""
        backend = None if launch.backend == "auto" else launch.backend
        info = D.init_from_env(backend, launch.timeout_s)
        device = info.device if info.device.type == "cuda" else resolve_device(device)
        if release_memory:  # before the model build and the loader's forked workers
            release_freed_memory(device.type)
        local = D.get_local_world_size() if D.is_initialized() else 1
        return cls(info.rank, info.world_size, local, device)

    def autocast(self, precision: str) -> Callable[[], Any]:
        return autocast(precision, self.device.type)
