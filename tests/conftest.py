"""Test-wide settings: offline hubs, no wandb, one torch thread a process on the 2-core CI machine.

Tests run with ``--import-mode=importlib`` (pyproject.toml), so pytest no longer puts each test file's
folder on ``sys.path``. The helper modules that tests import by bare name (``datakit``, ``evalkit``,
``kernel_oracles``, ``_launch``, ``_dist_jobs``, ...) stay in their folders, and exactly those folders are
put on ``sys.path`` here, before any test module is collected. Processes the tests spawn inherit
``sys.path`` (multiprocessing's spawn passes it on). Never ``import tests.x``: the venv ships an
unrelated top-level ``tests`` package.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
# One torch thread a process: pytest-xdist runs 2 workers on CI's 2 cores, and a test that trains in its
# own process otherwise takes torch's default of one thread a core, 4 threads on 2 cores; on these shared
# cores a training step was 3-4x slower with the default threads. Processes the tests start inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

HELPER_DIRS = ("core", "data", "eval", "kernels", "train")
for _name in HELPER_DIRS:
    _path = str(Path(__file__).resolve().parent / _name)
    if _path not in sys.path:
        sys.path.insert(0, _path)
