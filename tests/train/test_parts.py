"""The trainer's parts one at a time, on the real demo training set: ``Runtime``, ``TrainData``, ``Update``,
``StateIO`` and ``Reporter`` (the loop's tests run them together; these pin each one's own contract)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from trainkit import train_cfg

from toolkit.train import model as model_lib
from toolkit.train.batches import StepCounts, TrainData, open_data, step_counts
from toolkit.train.runtime import Runtime, resolve_device


@pytest.fixture
def parts(demo_train, tmp_path):
    """``build_parts`` of a 4-step openclip run (one process), and its config."""
    from toolkit.train.loop import build_parts

    cfg = train_cfg(demo_train, tmp_path / "run", steps=4, loss={"kind": "openclip", "mode": "gather"})
    return build_parts(cfg)


# ------------------------------------------------------------------ Runtime
def test_runtime_of_one_process(demo_train, tmp_path):
    cfg = train_cfg(demo_train, tmp_path / "run")
    rt = Runtime.start(cfg.launch, cfg.device)
    assert (rt.rank, rt.world_size, rt.local_world_size, rt.device.type) == (0, 1, 1, "cpu")
    with rt.autocast("fp32")():
        assert torch.ones(2, 2).matmul(torch.ones(2, 2)).dtype == torch.float32
    with rt.autocast("bf16")():
        assert torch.ones(2, 2).matmul(torch.ones(2, 2)).dtype == torch.bfloat16


def test_resolve_device_refuses_unknown_names():
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            resolve_device("cuda")


# ------------------------------------------------------------------ TrainData
def test_step_counts_from_steps_or_epochs(demo_train, tmp_path):
    cfg = train_cfg(demo_train, tmp_path / "run", steps=0, epochs=3)  # 160 samples, batch 16
    assert step_counts(cfg.data_plan(), 160) == StepCounts(per_epoch=10, total=30)
    assert step_counts(train_cfg(demo_train, tmp_path / "run", steps=7).data_plan(), 160) == StepCounts(10, 7)


def test_open_data_refuses_a_batch_larger_than_the_data(demo_train, tmp_path):
    cfg = train_cfg(demo_train, tmp_path / "run", batch_size=320)
    rt = Runtime.start(cfg.launch, cfg.device)
    with pytest.raises(ValueError, match="160"):
        open_data(cfg.data_plan(), cfg.loss, rt.world_size)


@pytest.mark.parametrize(("micro", "offloaded"), [(0, False), (16, False), (4, True)])
def test_train_data_is_offloaded_when_the_cache_splits_the_batch(demo_train, tmp_path, micro, offloaded):
    cfg = train_cfg(demo_train, tmp_path / "run", steps=3)
    rt = Runtime.start(cfg.launch, cfg.device)
    data = TrainData(cfg.data_plan(), rt, open_data(cfg.data_plan(), cfg.loss, rt.world_size), micro)
    assert data.offloaded is offloaded and data.local_batch_size == 16 and data.steps == StepCounts(10, 3)
    batches = list(data.batches(1))
    assert [int(b["step"]) for b in batches] == [1, 2] and list(data.batches(3)) == []
    image, text, index = data.to_device(batches[0])
    assert image.shape[0] == text.shape[0] == index.shape[0] == 16


# ------------------------------------------------------------------ model and Update
def test_model_returns_named_towers(parts):
    p = parts
    batch = next(iter(p.data.batches(0)))
    image, text, _ = p.data.to_device(batch, p.built.model.trim_tokens)
    out = p.built.model(image, text)
    assert isinstance(out, model_lib.Towers) and out.logit_bias is None
    assert out.image_features.shape == out.text_features.shape and out.scalars() == [out.logit_scale]
    assert torch.allclose(out.image_features.norm(dim=-1), torch.ones(16), atol=1e-5)


def test_update_steps_on_a_finite_value_and_skips_a_non_finite_one(parts):
    p = parts
    params = [q for q in p.built.model.clip.parameters() if q.requires_grad]
    before = [q.detach().clone() for q in params]
    for q in params:
        q.grad = torch.ones_like(q)
    p.update.begin(0, p.data.steps_per_epoch)
    skipped = p.update.finish(torch.tensor(math.nan))
    assert not skipped.applied and "loss" in skipped.what_failed()
    assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True)) and params[0].grad is None
    for q in params:
        q.grad = torch.ones_like(q)
    applied = p.update.finish(torch.tensor(1.0))
    assert applied.applied and float(applied.grad_norm) > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, params, strict=True))


# ------------------------------------------------------------------ StateIO
def test_state_io_round_trip(parts, demo_train, tmp_path):
    from toolkit.train.checkpoint.state import nonfinite_note
    from toolkit.train.loop import build_parts
    from toolkit.train.trainstate import TrainState

    p = parts
    with torch.no_grad():
        p.built.model.clip.logit_scale.fill_(1.234)
    assert p.io.save(TrainState(step=2, samples_seen=32)) and not p.io.save(
        TrainState(step=2, samples_seen=32)
    )
    p.io.close()
    again = build_parts(p.cfg)
    state = again.io.resume()
    assert (state.step, state.samples_seen, again.io.last_step) == (2, 32, 2)
    assert float(again.built.model.clip.logit_scale.detach()) == pytest.approx(1.234)
    note = nonfinite_note(again.io, first_bad_step=4)  # step 2's checkpoint precedes it: named, kept
    assert "step-00000002" in note and (tmp_path / "run" / "checkpoints" / "step-00000002").is_dir()


# ------------------------------------------------------------------ Reporter
def test_reporter_writes_logged_steps_and_counts_data_waits(parts, tmp_path):
    import time

    from toolkit.train.report import Reporter
    from toolkit.train.trainstate import TrainState

    p = parts
    (tmp_path / "run").mkdir()  # the stage's books create it in a real run
    report = Reporter(p.cfg.report_plan(), p.rt, p.data.steps, None)

    def slow():
        for i in range(2):
            time.sleep(0.05)
            yield {"index": torch.arange(i * 16, (i + 1) * 16), "step": i}

    state = TrainState()
    for batch in report.timed(slow()):
        assert report.window.data_wait_s >= 0.05  # this batch's wait (a logged step restarts the window)
        state.step += 1
        state.samples_seen += 16
        outcome = p.update.finish(torch.tensor(0.5))
        report.step_done(state, batch, outcome, 1e-3, p.update)
    report.close()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"], r["samples_seen"]) for r in records] == [(1, 0.5, 16), (2, 0.5, 32)]
    assert all(r["data_wait_s"] >= 0.05 for r in records)
