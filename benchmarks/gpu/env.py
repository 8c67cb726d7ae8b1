"""Section 1: the environment (GPU, torch, CUDA, triton, and the packages the other sections use)."""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version

from benchmarks.gpu.common import Context, GiB, Section

PACKAGES = ("torch", "torchvision", "triton", "open_clip_torch", "webdataset", "inf-cl", "numpy")


def _version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def run(ctx: Context, sec: Section) -> None:
    import torch

    row: dict = {"python": platform.python_version(), "cpus": os.cpu_count(), "device": ctx.device}
    row |= {name: _version(name) for name in PACKAGES}
    row["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        row |= {
            "gpu": props.name,
            "gpus": torch.cuda.device_count(),
            "gpu_mem_gib": round(props.total_memory / GiB, 1),
            "sms": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}",
            "cudnn": torch.backends.cudnn.version(),
        }
    else:
        row["gpu"] = None
        sec.notes.append(
            "no CUDA device: the dry run's tiny sizes on the CPU (Triton under TRITON_INTERPRET=1)"
        )
    sec.rows.append(row)
