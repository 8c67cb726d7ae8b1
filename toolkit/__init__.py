"""cliptk: train CLIP models on limited hardware and evaluate them zero-shot.

Layers (imports point down only; tests/test_layers.py enforces it):
cli > pipeline > eval | train > data > models > kernels | core.
"""

__version__ = "0.1.0"
