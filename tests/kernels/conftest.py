"""Kernel-test fixtures: Triton interpreter on CPU, replayable seeds, NaN-poisoned output buffers.

TRITON_INTERPRET must be set before ``toolkit.kernels.triton_lse`` decorates its kernels (triton reads it
when ``@triton.jit`` runs), so it is set here, at collection, whenever there is no CUDA device.

Seeds (the ``gen`` fixture): by default each test gets a fixed seed of its own, derived from its node id,
so CI is reproducible (a failure comes back on the rerun, and a tolerance cannot fail one run in a
thousand on a lucky draw); ``CLIPTK_KERNEL_SEED=N`` runs with seed N (to replay), and
``CLIPTK_KERNEL_SEED=random`` draws a fresh seed per test (to explore more inputs locally). A failing
test's report has a "kernel seed" section with the seed and the command that replays it.
"""

from __future__ import annotations

import os
import secrets
import zlib

import pytest
import torch

SEED_ENV = "CLIPTK_KERNEL_SEED"

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def kernel_seed(nodeid: str) -> int:
    """This test's seed: $CLIPTK_KERNEL_SEED (an integer, or 'random' for a fresh one), else a stable
    hash of the test's node id."""
    chosen = os.environ.get(SEED_ENV, "").strip()
    if chosen == "random":
        return secrets.randbits(31)
    if chosen:
        try:
            return int(chosen)
        except ValueError:
            raise pytest.UsageError(f"{SEED_ENV}={chosen!r}: expected an integer or 'random'") from None
    return zlib.crc32(nodeid.encode()) & 0x7FFFFFFF


@pytest.fixture
def gen(request) -> torch.Generator:
    """A generator seeded by ``kernel_seed`` (module docstring); the seed is reported if the test fails."""
    seed = kernel_seed(request.node.nodeid)
    request.node.kernel_seed = seed
    return torch.Generator().manual_seed(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test that drew a seed gets a "kernel seed" section: the seed and how to replay it."""
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "kernel_seed", None)
    if seed is not None and report.failed:
        report.sections.append(
            ("kernel seed", f"seed {seed}; replay: {SEED_ENV}={seed} python -m pytest '{item.nodeid}'")
        )


@pytest.fixture
def poisoned(monkeypatch):
    """Make torch.empty/empty_like return NaN-filled float tensors, so an output entry a kernel forgets
    to write shows up as NaN instead of happening to hold a plausible value."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))
