"""The gradient cache gives the gradient of the whole global batch (one process and 2 gloo processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _launch import free_port, rank_env
from gradcache_jobs import LOSSES, grads, reference
from trainkit import ROOT, train_cfg, weights

from toolkit.train.run import run


def _rel(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-12)).item() for k in want)


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("micro", [3, 1])  # 3: micro-batches of 3, 3, 3, 1 (the last one smaller); 1: ten
def test_micro_batches_give_the_full_batch_gradient(loss, micro):
    assert _rel(grads(loss, micro, dropout=False), grads(loss, 0, dropout=False)) <= 1e-5
    # with patch dropout: the oracle keeps every micro-batch's graph (same masks), one loss, one backward
    assert _rel(grads(loss, micro, dropout=True), reference(loss, micro, dropout=True)) <= 1e-5


def test_without_replay_the_dropout_masks_would_differ(monkeypatch):
    """The dropout check is meaningful: other masks in the second pass change the gradient."""
    from toolkit.core import seeds

    calls = {"n": 0}
    original = seeds.stream_seed

    def drifting(seed, s, rank, i):  # a different seed every call: the second pass draws other masks
        calls["n"] += 1
        return original(seed, s, rank, i) + calls["n"]

    import gradcache_jobs

    monkeypatch.setattr(gradcache_jobs, "_seed", lambda rank: lambda i: drifting(3, 0, rank, i))
    assert _rel(grads("fastclip-v3", 3, dropout=True), reference("fastclip-v3", 3, dropout=True)) > 1e-3


@pytest.mark.dist
def test_two_gloo_processes_with_micro_batches_equal_one_process_without(tmp_path):
    port, procs = free_port(), []
    helpers = str(Path(__file__).parent)
    for rank in range(2):
        env = dict(
            os.environ,
            **rank_env(rank, 2, port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(ROOT), helpers, os.environ.get("PYTHONPATH", "")]),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(Path(helpers) / "gradcache_jobs.py"), str(tmp_path)],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name in LOSSES:
        want = grads(name, 0, dropout=False)  # one process, the whole global batch, no cache
        for r in range(2):
            assert _rel(ranks[r][(name, 2)], want) <= 1e-5, (name, r)  # 2 ranks x micro-batches of 2, 2, 1
            assert _rel(ranks[r][(name, 0)], want) <= 1e-5, (name, r)


def test_training_steps_with_the_cache_equal_steps_without(demo_train, tmp_path):
    # SGD: its update is linear in the gradient. (AdamW's m/sqrt(v) is ~sign(g) on the zero-initialised
    # attention biases, where fp32 summation-order noise of 1e-7 flips signs: the weights then differ by
    # ~1e-3 relative although every gradient agrees to 1e-6, as the tests above check directly.)
    sgd = {"optim": {"name": "sgd", "lr": 0.1}}
    run(train_cfg(demo_train, tmp_path / "plain", steps=3, batch_size=16, **sgd))
    run(train_cfg(demo_train, tmp_path / "cached", steps=3, batch_size=16, micro_batch_size=5, **sgd))
    assert _rel(weights(tmp_path / "cached"), weights(tmp_path / "plain")) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_offloaded_cuda_step_equals_the_cpu_step():
    """Pinned host batch, micro-batches copied on a side stream, cached features offloaded: the same
    gradients as the CPU run (TF32 off)."""
    import contextlib

    import gradcache_jobs

    from toolkit.train.step import StepInputs, forward_backward

    torch.backends.cuda.matmul.allow_tf32 = False
    model, _, loss, images, tokens, index = gradcache_jobs._setup("fastclip-v3", 0, 1, dropout=False)
    model.cuda()
    inputs = StepInputs(images.pin_memory(), tokens.pin_memory(), index.cuda())
    forward_backward(
        model,
        loss,
        inputs,
        micro_batch_size=3,
        seed_of=gradcache_jobs._seed(0),
        autocast=contextlib.nullcontext,
        offload_features=True,
    )
    got = {n: p.grad.cpu() for n, p in model.clip.named_parameters() if p.grad is not None}
    assert _rel(got, grads("fastclip-v3", 0, dropout=False)) <= 1e-4
