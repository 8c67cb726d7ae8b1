"""The OpenCLIP baseline's registry entry: every distributed mode, no per-sample state, the CLIP loss's
traffic (docs/distributed.md), the reference's CC3M baseline (``presets.py``)."""

from toolkit.train.losses.openclip.presets import PRESETS
from toolkit.train.losses.spec import ObjectiveSpec

SPEC = ObjectiveSpec(
    kind="openclip",
    title="the OpenCLIP baseline",
    target="toolkit.train.losses.openclip.loss:OpenCLIPLoss",
    presets=PRESETS,
)
