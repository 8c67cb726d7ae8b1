"""The OpenCLIP baseline's published setting: the reference's CC3M run (fastclip/presets.py) with the CLIP
loss in the gather mode (Optimization-AI/fast_clip README), as plain ``Preset`` data (train/presets.py)."""

from __future__ import annotations

from typing import Any

from toolkit.train.losses.fastclip.presets import CC3M_RUN

PRESETS: dict[str, dict[str, Any]] = {
    "cc3m-openclip": {
        "description": "CC3M, ResNet-50, OpenCLIP baseline (reference README)",
        **CC3M_RUN,
        "loss": {"kind": "openclip", "mode": "gather"},
    },
}
