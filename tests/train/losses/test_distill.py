"""The distill objective (``--loss distill``, one process) against its float64 full-matrix oracle
(tests/train/distill_oracle.py): value and gradients of both feature sets and of the logit scale's p, batch 1,
odd batches, a teacher width other than the student's, several strips of the torch backend, float32 features,
the Triton backend under TRITON_INTERPRET=1 (a subprocess: the variable must precede triton's import), and the
gradient cache against one pass. This file is also that subprocess's script (``python test_distill.py
triton``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distill_oracle import inputs, naive_distill

from toolkit.core.config import ConfigError, build
from toolkit.kernels import clip_loss
from toolkit.train.losses import LossConfig, build_loss
from toolkit.train.losses.distill.config import DistillConfig

WEIGHT, TEACHER_TAU = 0.7, 0.05
# (b, d, d_ref): batch 1, odd batches, teacher narrower and wider than the student
CASES = [(1, 6, 6), (2, 5, 9), (7, 8, 3), (13, 6, 6), (33, 7, 12)]


def objective(mode: str, backend: str = "torch", weight: float = WEIGHT, teacher_tau: float = TEACHER_TAU):
    return build_loss(
        LossConfig(
            kind="distill",
            mode=mode,
            backend=backend,
            distill=DistillConfig(weight=weight, teacher_tau=teacher_tau),
        )
    )


def value_and_grads(fn, x, y, p) -> tuple[torch.Tensor, ...]:
    """(value, d/dx, d/dy, d/dp) of fn(x, y, exp(p)) at fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, y, p)]
    value = fn(leaves[0], leaves[1], leaves[2].exp())
    return (value.detach(), *torch.autograd.grad(value, leaves))


def check_against_oracle(
    loss, x, y, u, v, p, rtol: float, atol: float, weight: float = WEIGHT, teacher_tau: float = TEACHER_TAU
) -> None:
    b = x.shape[0]
    got = value_and_grads(lambda xs, ys, a: loss(xs, ys, a, torch.arange(b), reference=(u, v)), x, y, p)
    want = value_and_grads(
        lambda xs, ys, a: naive_distill(xs, ys, a, u.double(), v.double(), teacher_tau, weight),
        x.double(),
        y.double(),
        p.double(),
    )
    for name, g, w in zip(("value", "dx", "dy", "dp"), got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}d{}dref{}".format(*c))
@pytest.mark.parametrize("backend", ["torch", "naive"])
@pytest.mark.parametrize("mode", ["gather", "fastclip"])
def test_value_and_gradients_match_the_float64_oracle(mode, backend, case):
    b, d, d_ref = case
    x, y, u, v, p = inputs(b, d, d_ref, seed=100 * b + d_ref)
    loss = objective(mode, backend)
    check_against_oracle(loss, x, y, u, v, p, rtol=1e-9, atol=1e-12)
    assert loss.reads_reference
    torch.testing.assert_close(loss.global_value(), naive_distill(x, y, p.exp(), u, v, TEACHER_TAU, WEIGHT))


def test_several_strips_of_the_torch_backend():
    """B = 2100: the torch backend's strips of 2^21 entries hold 998 rows, so 998 + 998 + 104 (uneven)."""
    x, y, u, v, p = inputs(2100, 8, 5, seed=3)
    for mode in ("gather", "fastclip"):
        check_against_oracle(objective(mode), x, y, u, v, p, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mode", ["gather", "fastclip"])
def test_float32_features(mode):
    x, y, u, v, p = inputs(57, 16, 24, seed=5)
    check_against_oracle(
        objective(mode), x.float(), y.float(), u.float(), v.float(), p.float(), rtol=2e-5, atol=2e-6
    )


def test_weight_zero_is_the_clip_loss_and_a_teacher_equal_to_the_student_adds_nothing():
    x, y, u, v, p = inputs(9, 6, 4, seed=11)
    plain = value_and_grads(lambda xs, ys, a: clip_loss(xs, ys, a), x, y, p)
    for mode in ("gather", "fastclip"):
        loss = objective(mode, weight=0.0)
        got = value_and_grads(
            lambda xs, ys, a, o=loss: o(xs, ys, a, torch.arange(9), reference=(u, v)), x, y, p
        )
        for g, w in zip(got, plain, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-13)
        # weight 1, teacher = the student at the student's temperature: KL 0 and at its minimum (zero
        # gradient)
        loss = objective(mode, weight=1.0, teacher_tau=float(1 / p.exp()))
        got = value_and_grads(
            lambda xs, ys, a, o=loss: o(xs, ys, a, torch.arange(9), reference=(x, y)), x, y, p
        )
        for g in got:
            torch.testing.assert_close(g, torch.zeros_like(g), rtol=0, atol=1e-12)


def test_refuses_other_modes_and_a_missing_or_misshapen_reference():
    for mode in ("disco", "ring"):
        with pytest.raises(ConfigError, match="gather or fastclip"):
            build(LossConfig, {"kind": "distill", "mode": mode}, source="run.yaml", prefix="loss")
    x, y, u, v, p = inputs(7, 6, 4, seed=1)
    loss = objective("gather")
    with pytest.raises(ValueError, match="needs reference"):
        loss(x, y, p.exp(), torch.arange(7))
    with pytest.raises(ValueError, match="b = 7"):
        loss(x, y, p.exp(), torch.arange(7), reference=(u[:6], v[:6]))
    # the checks shared with contrastive_loss and drrho (modes/common.py, base.reference_rows)
    with pytest.raises(ValueError, match="distill: reference must be"):
        loss(x, y, p.exp(), torch.arange(7), reference=u)
    with pytest.raises(ValueError, match="same shape"):
        loss(x, y[:6], p.exp(), torch.arange(7), reference=(u, v))
    with pytest.raises(ValueError, match="logit_scale must be 0-d"):
        loss(x, y, p.exp().reshape(1), torch.arange(7), reference=(u, v))


def test_the_loss_section_is_omitted_from_records_at_its_default():
    """Configs recorded before the objective existed (checkpoints, results) keep their hash and records."""
    from toolkit.core.config import to_dict

    assert "distill" not in to_dict(LossConfig())
    assert to_dict(LossConfig(kind="distill", mode="gather", distill=DistillConfig(weight=0.3)))[
        "distill"
    ] == {"weight": 0.3, "teacher_tau": 0.01}


@pytest.mark.parametrize("micro", [3, 1])
def test_the_gradient_cache_gives_the_gradient_of_one_pass(micro):
    """forward_backward with micro-batches of 3, 3, 3, 1 (or ten of 1) equals the plain step: the reference
    rows reach the loss for the whole local batch."""
    assert _rel(_model_grads(micro), _model_grads(0)) <= 1e-5


def _model_grads(micro: int) -> dict[str, torch.Tensor]:
    from gradcache_jobs import GLOBAL_BATCH, _batch, _model, _seed

    from toolkit.train.step import StepInputs, forward_backward

    model = _model(dropout=False)
    images, tokens, index = _batch()
    _, _, u, v, _ = inputs(GLOBAL_BATCH, 4, 12, seed=9)
    forward_backward(
        model,
        objective("fastclip"),
        StepInputs(images, tokens, index, reference=(u.float(), v.float())),
        micro_batch_size=micro,
        seed_of=_seed(0),
        autocast=contextlib.nullcontext,
    )
    return {n: p.grad.clone() for n, p in model.clip.named_parameters() if p.grad is not None}


def _rel(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(((got[k] - want[k]).norm() / want[k].norm().clamp_min(1e-12)).item() for k in want)


def test_triton_backend_under_the_interpreter():
    pytest.importorskip("triton")
    tests_train = Path(__file__).resolve().parents[1]
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(
            [str(tests_train.parents[1]), str(tests_train), os.environ.get("PYTHONPATH", "")]
        ),
    )
    done = subprocess.run(
        [sys.executable, __file__, "triton"], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().endswith("triton ok")


def _triton_cases() -> None:
    """float32 features on the triton backend (interpreted on the CPU) against the float64 oracle."""
    for b, d, d_ref in ((1, 16, 16), (37, 24, 40)):
        x, y, u, v, p = inputs(b, d, d_ref, seed=b)
        for mode in ("gather", "fastclip"):
            check_against_oracle(
                objective(mode, "triton"),
                x.float(),
                y.float(),
                u.float(),
                v.float(),
                p.float(),
                rtol=1e-4,
                atol=1e-5,
            )
    print("triton ok")


if __name__ == "__main__" and sys.argv[1:] == ["triton"]:
    _triton_cases()
