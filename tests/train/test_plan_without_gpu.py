"""`toolkit plan` for a GPU job on a machine without a GPU (issue 43 item 18): it stopped after 48 s asking
for --measure, and `--measure` failed with "Found no NVIDIA driver"; on the CPU `--measure` printed nothing
for minutes. Now a CUDA plan without measured figures uses an estimate calibrated on the H100 run's
measured peak, and says so; `--measure` without a GPU fails at once in one line; measuring shows progress."""

from __future__ import annotations

import logging

import pytest
from typer.testing import CliRunner

from toolkit.cli.main import app
from toolkit.core.config import build
from toolkit.train.plan import estimate, planner
from toolkit.train.plan.config import PlanConfig


def test_a_cuda_plan_without_a_gpu_uses_the_labelled_estimate():
    res = CliRunner().invoke(
        app,
        [
            "plan",
            "--model",
            "ViT-B-32",
            "--batch-size",
            "32768",
            "--nproc-per-node",
            "8",
            "--device-memory-gb",
            "80",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "(estimate, no GPU here: the H100 run's measured ViT-B-32 bf16 peak" in res.output, res.output
    assert "largest micro-batch at global batch 32768:" in res.output


def test_the_estimate_reproduces_the_h100_peak_it_is_calibrated_on():
    """The H100 configuration itself (bf16, batch 512, captions of 12 tokens) plans to the measured peak; the
    full context and fp32 plan more, a non-ViT tower is refused naming --measure."""
    cfg = build(
        PlanConfig,
        {
            "model": "ViT-B-32",
            "batch_size": 512,
            "loss": "openclip",
            "mode": "gather",
            "precision": "bf16",
            "text_tokens": estimate.H100_TEXT_TOKENS,
        },
    )
    h100 = planner.run(cfg)
    assert h100.total == pytest.approx(estimate.H100_PEAK_BYTES, rel=1e-9)
    assert h100.source.startswith("estimate")
    full = planner.run(build(PlanConfig, {**_fields(cfg), "text_tokens": 0}))
    fp32 = planner.run(build(PlanConfig, {**_fields(cfg), "precision": "fp32"}))
    assert (
        h100.per_sample_bytes < full.per_sample_bytes and fp32.per_sample_bytes == 2 * h100.per_sample_bytes
    )
    with pytest.raises(ValueError, match="not a ViT.*--measure"):
        planner.run(build(PlanConfig, {"model": "RN50", "batch_size": 512}))


def _fields(cfg: PlanConfig) -> dict:
    from toolkit.core.config import to_dict

    return to_dict(cfg)


def test_measure_on_cuda_without_a_gpu_fails_at_once_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    res = CliRunner().invoke(app, ["plan", "--model", "ViT-B-32", "--measure"])
    assert res.exit_code == 1 and res.exception is None or isinstance(res.exception, SystemExit), res.output
    (line,) = [x for x in res.output.splitlines() if x.startswith("error:")]
    assert "--measure with device cuda" in line and "has none" in line, line


def test_measuring_on_the_cpu_shows_progress(caplog):
    with caplog.at_level(logging.INFO, logger="toolkit.plan"):
        res = CliRunner().invoke(
            app,
            [
                "plan",
                "--model",
                "cliptk-tiny",
                "--device",
                "cpu",
                "--measure",
                "-b",
                "64",
                "--set",
                "measure_sizes=[2, 4]",
            ],
        )
    assert res.exit_code == 0, res.output
    for i, m in ((1, 2), (2, 4)):
        assert (
            f"measuring the activations of cliptk-tiny (fp32, cpu) at micro-batch {m} ({i} of 2) in a "
            "fresh process" in caplog.text
        ), caplog.text
        assert f"micro-batch {m}: peak " in caplog.text, caplog.text
    assert "(measured [" in res.output
