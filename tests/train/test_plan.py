"""``toolkit plan``: the table's arithmetic, the CLI, --micro-batch-size auto, and the prediction against
the peak memory of a real CPU training run (within 15%)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from trainkit import ROOT, env, train_cfg

from toolkit.core.config import ConfigError, build
from toolkit.data.trainset.loader import make_loader
from toolkit.train.plan import memory, planner
from toolkit.train.plan.config import GiB, ModelShape, PlanConfig, model_shape
from toolkit.train.plan.memprobe import measure_activations as _REAL_MEASURE
from toolkit.train.plan.report import format_plan
from toolkit.train.plan.traffic import sent_bytes, step_traffic

TINY = ModelShape("t", num_params=1000, num_trainable=1000, embed_dim=8, sample_bytes=100)


def _cfg(**over) -> PlanConfig:
    return build(PlanConfig, {"batch_size": 64, **over})


@pytest.mark.parametrize(("name", "slots"), [("adamw", 2), ("lamb", 2), ("lion", 1), ("sgd", 1)])
def test_optimizer_state_is_slots_times_fp32_params(name, slots):
    rows = memory.memory_rows(_cfg(optimizer=name), TINY, 0.0, 0.0)
    assert rows[f"optimizer state ({name})"] == slots * 4 * 1000
    assert rows["parameters"] == rows["gradients"] == 4000


def test_micro_batch_rows():
    cfg = _cfg(nodes=2, nproc_per_node=2, micro_batch_size=4, mode="gather", loss="openclip")  # b = 16
    rows = memory.memory_rows(cfg, TINY, 100.0, 10.0, overhead=7.0)
    assert rows["activations (micro-batch 4)"] == 100 + 10 * 4
    assert rows["runtime buffers (measured)"] == 7.0
    assert rows["cached features + grads"] == 4 * 2 * 2 * 16 * 8
    assert rows["batch inputs"] == 2 * 4 * 100  # cuda: two micro-batches in flight (offload)
    assert rows["loss features"] == 2 * 64 * 8 * 4 * 2  # gathered x, y and their gradients
    off = memory.memory_rows(_cfg(nodes=2, nproc_per_node=2, micro_batch_size=0), TINY, 100.0, 10.0)
    assert off["activations (micro-batch 16)"] == 100 + 10 * 16 and off["cached features + grads"] == 0


def test_traffic_is_the_ledger_formula():
    cfg = _cfg(nodes=1, nproc_per_node=4, loss="fastclip-v3")
    got = planner.traffic(cfg, TINY)
    assert got["openclip/gather"] == sent_bytes(step_traffic("gather", 4, 16, 8, 1000), 4)
    # all_gather of [b, 2, d] fp32: (K-1)·n wire bytes; fastclip's feature bytes are half of gather's
    assert got["openclip/fastclip"]["features"] == 3 * 2 * 16 * 8 * 4
    assert (
        got["openclip/gather"]["features"] + got["openclip/gather"]["feature_grads"]
        == 2 * got["openclip/fastclip"]["features"]
    )
    assert got["fastclip-v3/fastclip"]["scalars"] == 3 * 16 * 5 * 8
    assert got["openclip/gather"]["param_grads"] == 2 * 3 / 4 * 4000


def test_largest_fit_is_the_boundary():
    cfg = _cfg(device_memory_gb=1.0, device="cuda")
    fit = memory.largest_fit(cfg, TINY, 1e6, 1e6, 0.0)
    budget = GiB

    def total(big_b, m):
        return sum(memory.memory_rows(cfg, TINY, 1e6, 1e6, 0.0, big_b, m).values())

    n = fit["global_batch_no_cache"]
    assert total(n, 0) <= budget < total(n + 1, 0)
    assert fit["micro_batch"] == 64  # the whole local batch fits
    assert memory.largest_fit(_cfg(device_memory_gb=0.01), TINY, 1e6, 1e6, 0.0)["micro_batch"] == 9


def test_cli_prints_the_table_and_refuses_bad_input():
    """`toolkit plan` through the CLI app in this process (Typer's CliRunner): four launches of a fresh
    interpreter cost ~2 s each and prove nothing more (`python -m toolkit`: tests/test_toolkit_cli.py)."""
    from typer.testing import CliRunner

    from toolkit.cli.main import app

    def invoke(*args: str):
        return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})

    res = invoke(
        "plan",
        "--model",
        "cliptk-tiny",
        "-b",
        "256",
        "--nproc-per-node",
        "2",
        "--device",
        "cpu",
        "--device-memory-gb",
        "2",
        "--micro-batch-size",
        "16",
    )
    assert res.exit_code == 0, res.output
    for text in (
        "optimizer state (adamw)",
        "activations (micro-batch 16)",
        "openclip/ring",
        "fastclip-v3/fastclip",
        "largest global batch with micro-batch 16",
    ):
        assert text in res.stdout
    bad = invoke("plan", "--optimizer", "adam")
    assert bad.exit_code == 2 and "did you mean 'adamw'" in bad.stderr, bad.output
    # on the CPU a missing entry asks for --measure (cheap there); a CUDA plan uses the estimate instead
    unknown = invoke("plan", "--model", "cliptk-small", "--precision", "bf16", "--device", "cpu")
    assert unknown.exit_code == 1 and "--measure" in unknown.stderr, unknown.output
    helptext = invoke("plan", "--help").stdout
    for flag in ("--measure", "--device-memory-gb", "--num-samples", "--grad-dtype", "--optimizer"):
        assert flag in helptext


def test_micro_batch_auto_config_and_cli(tmp_path):
    from toolkit.train.config import TrainConfig

    cfg = build(TrainConfig, {"data": "d", "out": "o", "micro_batch_size": "auto"})
    assert cfg.micro_batch_size == "auto"
    with pytest.raises(ConfigError, match="micro_batch_size"):
        build(TrainConfig, {"data": "d", "out": "o", "micro_batch_size": "big"})
    from typer.testing import CliRunner

    from toolkit.cli.main import app

    argv = ["train", "--data", str(tmp_path), "--out", str(tmp_path / "r"), "--micro-batch-size", "lots"]
    res = CliRunner().invoke(app, argv)  # the CLI app in this process: a launch costs ~2 s and proves no more
    assert res.exit_code == 2 and "--micro-batch-size" in res.stderr, res.output


def test_micro_batch_auto_on_cpu_follows_the_budget(demo_train, tmp_path):
    from toolkit.train.loop import build_parts
    from toolkit.train.plan.automicro import plan_config

    fixed, per_sample, overhead = memory.MEASURED[("cliptk-tiny", "fp32", "cpu")]
    for budget_gb in (0.25, 8.0):
        p = build_parts(
            train_cfg(
                demo_train,
                tmp_path / f"r{budget_gb}",
                batch_size=64,
                micro_batch_size="auto",
                memory_budget_gb=budget_gb,
            )
        )
        p.io.close()
        pcfg = plan_config(p.cfg, 1, 1, "cpu", p.data.num_samples)
        shape = model_shape("cliptk-tiny")

        def total(m, pcfg=pcfg, shape=shape):
            return sum(memory.memory_rows(pcfg, shape, fixed, per_sample, overhead, micro=m).values())

        if budget_gb == 8.0:
            assert p.micro_batch_size == 0 and total(0) <= 8 * GiB  # the whole batch fits: no cache
        else:  # about (256 MiB - 153 MiB fixed) / 3.08 MiB per sample
            m = p.micro_batch_size
            assert 10 < m < 64 and total(m) <= 0.25 * GiB < total(m + 1), m


MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # RSS follows live memory (docs/training.md)
_FITS: dict = {}  # measure_activations' real fits by arguments, shared by the parametrisations below


def _measured_once(*args, **kwargs):
    """``--measure``'s real fit (two fresh probe processes), once per argument set: both parametrisations
    below ask for the same one (the model's tower passes do not depend on the batch or micro-batch)."""
    key = (args, tuple(sorted(kwargs.items())))
    if key not in _FITS:
        _FITS[key] = _REAL_MEASURE(*args, **kwargs)
    return _FITS[key]


@pytest.mark.parametrize(("batch", "micro"), [(64, 16), (64, 0)])
def test_prediction_matches_a_measured_cpu_run(demo_train, tmp_path, batch, micro, monkeypatch):
    from toolkit.train.plan import memprobe

    for key, value in MALLOC.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(memprobe, "measure_activations", _measured_once)
    # the trainer cuts each batch after its longest caption: the plan is told the data's longest one
    tokens = next(iter(make_loader(demo_train, batch_size=160, shuffle=False)))["tokens"]
    longest = int(tokens.argmax(dim=-1).max()) + 1
    assert longest < tokens.shape[1]  # the cut matters here
    predicted = planner.run(
        _cfg(
            batch_size=batch,
            micro_batch_size=micro,
            device="cpu",
            num_samples=160,
            measure=True,
            text_tokens=longest,
        )
    ).total
    job = ROOT / "tests" / "train" / "plan_jobs.py"
    proc = subprocess.run(
        [sys.executable, str(job), str(demo_train), str(tmp_path / "run"), str(batch), str(micro)],
        env={**env(), **MALLOC, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'train'}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])["measured"]
    assert abs(predicted - measured) <= 0.15 * measured, (predicted, measured)


def test_caption_length_needs_a_measurement():
    with pytest.raises(ValueError, match="--measure"):
        planner.run(_cfg(device="cpu", text_tokens=12))


@pytest.mark.parametrize("mode", ["pixels", "jpeg", "index"])
def test_the_disk_figure_is_the_storage_modes(mode):
    from toolkit.data.trainset import storage

    result = planner.run(_cfg(model="cliptk-tiny", device="cpu", storage=mode, num_samples=1000))
    want = storage.get(mode).disk_bytes_per_sample(36, 32)  # cliptk-tiny: 32 px stored at 36 (crop margin)
    assert result.disk_bytes_per_sample == want > 0
    assert f"training set on disk ({mode})" in format_plan(result)
    with pytest.raises(ConfigError, match="storage 'tar': not a storage mode"):
        _cfg(storage="tar")


def test_patch_dropout_scales_the_tabled_activations_and_a_stage_plan_has_memory_per_stage():
    """Without --measure: the table's full-sequence activations per sample times the kept share of layers x
    tokens x width (cliptk-tiny: 4 layers of width 128 in both towers, 64 patches + class, 32 positions);
    each stage's memory is the plan's with its own share of the activations."""
    base = memory.MEASURED[("cliptk-tiny", "fp32", "cpu")][1]
    dropped = planner.run(PlanConfig(device="cpu", patch_dropout=0.5))
    assert dropped.per_sample_bytes == pytest.approx(base * (33 + 32) / (65 + 32))
    staged = planner.run(PlanConfig(device="cpu", batch_size=64, stages="16px,8tok:0.75;:0.25"))
    low, full = staged.stage_memory.values()
    assert list(staged.stage_memory) == [
        "stage 1 (16 px, 8 tok) per step",
        "stage 2 (full px, full tok) per step",
    ]
    assert full == pytest.approx(staged.total)
    share = (17 + 8) / (65 + 32)
    assert low == pytest.approx(staged.total - 64 * base * (1 - share))
    assert "memory per device per stage" in format_plan(staged)
