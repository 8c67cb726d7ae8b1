"""FastCLIP (arXiv 2407.01445) with the semantics of the reference implementation Optimization-AI/fast_clip.

- ``FastCLIPLoss`` (v0–v3) and its per-sample state (``tables``: one copy per node, checkpointed via
  ``state_dict``); ``individual``: v2's per-sample temperatures; ``estimators``: the gathered global batch
  and the log-domain moving averages.
- ``gamma_at_epoch`` / ``gamma_at_step``: the inner learning-rate schedules.
See docs/fastclip.md. Import from the modules (``fastclip.loss.FastCLIPLoss``): the package stays empty so
that importing one piece does not load the others.
"""
