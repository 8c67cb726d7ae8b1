"""An objective from outside toolkit/: a package written into a temporary folder, holding its class and one
``register`` call, is trained, resumed and planned by the real trainer, with no file of toolkit/ changed.

The objective keeps per-sample state (a visit count per sample id, a buffer of its state dict) and
reports it as a metric, so a resume that lost the objective's state would show it at the first resumed
step; its one fact for ``toolkit plan`` is one float32 column per sample of host tables.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import textwrap

import pytest
import torch
from trainkit import train_cfg, weights

from toolkit.core.config import build
from toolkit.train.losses import registry

INIT = """
from toolkit.train.losses import register

register("counted", "countedclip.loss:CountedCLIPLoss", {"counted-clip": {}},
         table_columns=lambda fields: 1)  # its visit counts, one float32 column per sample
"""

LOSS = '''
import torch

from toolkit.train.losses.base import TrainingLoss
from toolkit.train.losses.modes import contrastive_loss


class CountedCLIPLoss(TrainingLoss):
    """The CLIP loss over the global batch (gather mode) that counts each sample's visits."""

    needs_data_size = True

    def __init__(self, cfg, data_size, group=None, *, check_sizes=True):
        super().__init__(cfg, group, check_sizes=check_sizes)
        self.register_buffer("visits", torch.zeros(data_size))

    def forward(self, x, y, logit_scale, index, logit_bias=None):
        self.visits[index] += 1
        share = contrastive_loss(x, y, logit_scale, mode="gather", group=self.group,
                                 check_sizes=self.check_sizes)
        self._last = share.detach()
        return share

    def metrics(self):
        return {"visits": float(self.visits.sum())}
'''


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """The package ``countedclip`` in a temporary folder, imported (its ``register`` call runs)."""
    package = tmp_path / "plugins" / "countedclip"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(INIT))
    (package / "loss.py").write_text(textwrap.dedent(LOSS))
    monkeypatch.setattr(registry, "_SPECS", registry.specs())  # the built-ins; restored after the test
    monkeypatch.syspath_prepend(str(package.parent))
    importlib.import_module("countedclip")
    yield
    for name in [m for m in sys.modules if m.split(".")[0] == "countedclip"]:
        del sys.modules[name]


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_an_objective_from_a_package_trains_and_resumes(counted, demo_train, tmp_path):
    from toolkit.train.run import run

    out = tmp_path / "run"
    loss = {"kind": "counted", "mode": "gather"}
    result = run(train_cfg(demo_train, out, steps=6, loss=loss, checkpoint={"every_steps": 3}))
    assert result.counts["step"] == 6
    uninterrupted = weights(out)
    assert [r["visits"] for r in _records(out)] == [16.0 * t for t in range(1, 7)]

    shutil.rmtree(out / "checkpoints" / "step-00000006")  # resume from step 3's checkpoint
    (out / "metrics.jsonl").unlink()
    result = run(
        train_cfg(demo_train, out, steps=6, loss=loss, checkpoint={"every_steps": 3, "resume": "latest"})
    )
    assert result.counts["step"] == 6
    resumed = _records(out)
    # the objective's state came back with the checkpoint: step 4 counts steps 1-3's visits too
    assert [(r["step"], r["visits"]) for r in resumed] == [(t, 16.0 * t) for t in (4, 5, 6)]
    for key, value in weights(out).items():
        assert torch.allclose(value, uninterrupted[key], rtol=0, atol=1e-6), key


def test_an_objective_from_a_package_is_planned(counted):
    from toolkit.train.plan import planner
    from toolkit.train.plan.config import PlanConfig
    from toolkit.train.plan.report import format_plan

    cfg = build(
        PlanConfig,
        {
            "model": "cliptk-tiny",
            "loss": "counted-clip",
            "mode": "gather",
            "nproc_per_node": 2,
            "batch_size": 64,
            "num_samples": 1000,
            "device": "cpu",
        },
    )
    plan = planner.run(cfg)
    assert plan.table_bytes_per_node == 4.0 * 1000  # its spec's one column
    assert plan.traffic["counted-clip/gather"] == plan.traffic["openclip/gather"]  # the CLIP loss's modes
    assert "counted-clip" in format_plan(plan)


def test_a_name_registered_later_is_known_everywhere(counted):
    """Names are looked up when used: what registered after import is accepted by the config and plan."""
    from toolkit.train.losses.config import LossConfig, loss_fields

    assert "counted-clip" in registry.loss_names() and loss_fields("counted-clip") == {"kind": "counted"}
    assert LossConfig(kind="counted", mode="ring").name == "counted-clip"
