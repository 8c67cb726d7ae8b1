"""Deterministic seeds without generator state: splitmix64's constants and mixers, in one place.

- :func:`splitmix64` (its finaliser, on uint64 arrays): the batch order's Feistel rounds
  (``data/trainset/order.py``) and the random crops' streams keyed by (seed, step, id) (``data/augment.py``);
- :func:`stream_seed` (one 63-bit integer): the trainer's per-(step, rank, micro-batch) seed of torch's
  generators (``train/step.py``), so a resumed run, at any world size, draws what an uninterrupted one would.

Both are fixed forever: the values of existing runs (their order, crops and dropout masks after a resume)
depend on them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (2^64 / golden ratio, odd)
MUL1, MUL2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # its finaliser's multipliers
MASK64 = 0xFFFFFFFFFFFFFFFF


def splitmix64(v: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (wrapping: call under ``np.errstate(over='ignore')``)."""
    import numpy as np

    v = v ^ (v >> np.uint64(30))
    v = v * np.uint64(MUL1)
    v = v ^ (v >> np.uint64(27))
    v = v * np.uint64(MUL2)
    return v ^ (v >> np.uint64(31))


def stream_seed(seed: int, step: int, rank: int, micro: int) -> int:
    """A 63-bit seed for one micro-batch of one step on one rank: no generator state has to be saved,
    so a resumed run (at any world size) draws exactly what an uninterrupted one would have."""
    value = seed & MASK64
    for part, mult in zip((step, rank, micro), (GAMMA, MUL1, MUL2), strict=True):
        value = ((value ^ part) * mult + 0x632BE59BD9B4E019) & MASK64
        value ^= value >> 31
    return value & 0x7FFFFFFFFFFFFFFF
