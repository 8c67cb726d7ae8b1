"""Training: the objectives (``losses``), optimisers, presets and DDP gradient communication.

See docs/architecture.md for where each piece lives and docs/fastclip.md, docs/distributed.md for the maths.
"""
