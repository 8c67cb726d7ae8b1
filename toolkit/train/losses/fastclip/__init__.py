"""FastCLIP (arXiv 2407.01445) with the semantics of the reference implementation Optimization-AI/fast_clip.

- ``FastCLIPLoss`` (v0–v3) and its per-sample state (``tables``: one copy per node, checkpointed via
  ``state_dict``); ``OpenCLIPLoss`` the mini-batch baseline.
- ``gamma_at_epoch`` / ``gamma_at_step``: the inner learning-rate schedules; ``TemperatureControl``:
  lr rule and clamp for the learnable global temperature; ``clamp_logit_scale_``.
- ``presets``: the reference's published settings (CC3M, CC12M, LAION).
See docs/fastclip.md.
"""

from toolkit.train.fastclip.loss import VERSIONS, FastCLIPLoss
from toolkit.train.fastclip.openclip import OpenCLIPLoss, clamp_logit_scale_
from toolkit.train.fastclip.schedules import TemperatureControl, gamma_at_epoch, gamma_at_step

__all__ = ["VERSIONS", "FastCLIPLoss", "OpenCLIPLoss", "TemperatureControl", "clamp_logit_scale_",
           "gamma_at_epoch", "gamma_at_step"]
