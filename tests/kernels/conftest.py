"""Kernel-test fixtures: Triton interpreter on CPU, fresh seeds, NaN-poisoned output buffers.

TRITON_INTERPRET must be set before ``toolkit.kernels.triton_lse`` decorates its kernels (triton reads it
when ``@triton.jit`` runs), so it is set here, at collection, whenever there is no CUDA device.
"""

from __future__ import annotations

import os
import secrets

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def gen() -> torch.Generator:
    """A generator with a fresh seed each run (printed, so a failure can be replayed)."""
    seed = secrets.randbits(31)
    print(f"kernel test seed: {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def poisoned(monkeypatch):
    """Make torch.empty/empty_like return NaN-filled float tensors, so an output entry a kernel forgets
    to write shows up as NaN instead of happening to hold a plausible value."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))
