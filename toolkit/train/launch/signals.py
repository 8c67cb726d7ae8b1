"""Preemption: SIGTERM, SIGINT and SIGUSR1 (SLURM's ``--signal``) ask every rank to stop after the step.

The handler only sets a flag; the loop asks ``agreed()`` after each step, which ORs the flags of all
ranks (one 4-byte all_reduce when there is more than one rank), so a signal delivered to any rank stops
every rank at the same step, after which they write one checkpoint and exit cleanly.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch

from toolkit.core import dist as D
from toolkit.core.log import get_logger

SIGNALS = tuple(s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGUSR1", None)) if s is not None)


class PreemptionFlag:
    """Set by the signals above; see module docstring. Install once per training run, on every rank."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    @classmethod
    def install(cls) -> PreemptionFlag:
        flag = cls()
        for sig in SIGNALS:
            try:
                flag._previous[sig] = signal.signal(sig, flag._handle)
            except ValueError:  # not the main thread (e.g. an embedding application): no handler
                pass
        return flag

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            get_logger("train").warning(
                "received %s: finishing this step, then checkpoint and exit", signal.Signals(signum).name
            )
        self.received = signum

    def agreed(self, world_size: int) -> bool:
        """True on every rank when any rank received a signal. Called by every rank after each step."""
        local = self.received is not None
        if world_size <= 1:
            return local
        t = torch.tensor([1.0 if local else 0.0])
        if D.is_initialized() and D.dist.get_backend() == "nccl":
            t = t.cuda()
        return bool(D.all_reduce_sum(t, category=D.CHECKS).item() > 0)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
