"""Session fixtures of the trainer tests (helpers in trainkit.py)."""

from __future__ import annotations

import pytest
from trainkit import build_demo_trainset


@pytest.fixture(scope="session")
def demo_train(tmp_path_factory):
    """160 real emoji pairs (Twemoji + Unicode names) as cliptk-tiny training shards of 50."""
    return build_demo_trainset(tmp_path_factory.mktemp("demo_train"))
