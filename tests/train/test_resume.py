"""Checkpoints and resume: a killed run continues exactly; SIGTERM checkpoints and exits 0; a damaged
checkpoint is skipped."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainkit import ROOT, env, metrics, run_cli, toolkit_cmd, train_cfg, weights

from toolkit.train.checkpoint.format import CheckpointInvalid, latest_valid, verify
from toolkit.train.run import run

STEPS = 40
ARGS = [
    "--batch-size",
    "16",
    "--loss",
    "fastclip-v3",
    "--workers",
    "0",
    "--log-every",
    "1",
    "--set",
    "tensorboard=false",
    "--set",
    "optim.warmup_steps=5",
    "--set",
    "loss.fastclip.gamma_decay_epochs=2",
]


def _train_args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "--data", str(data), "--out", str(out), "--steps", str(STEPS), *ARGS, *extra]


def _wait_for(predicate, proc: subprocess.Popen, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(
                f"training ended (code {proc.returncode}) before the point to interrupt it:\n"
                + proc.stdout.read()[-3000:]
            )
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("timed out waiting for the training to reach the interruption point")
        time.sleep(0.05)


def _tables(ckpt_dir: Path) -> dict:
    return load_file(str(ckpt_dir / "loss_state.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(demo_train, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    result = run_cli(_train_args(demo_train, out, "--checkpoint-every", "5"))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_sigkill_after_a_checkpoint_then_resume_equals_the_uninterrupted_run(
    demo_train, uninterrupted, tmp_path
):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        toolkit_cmd(*_train_args(demo_train, out, "--checkpoint-every", "5")),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _wait_for(lambda: (out / "checkpoints" / "step-00000015" / "checkpoint.json").is_file(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    killed_at = max(r["step"] for r in metrics(out))
    assert killed_at < STEPS, "the job finished before the kill"
    resumed = run_cli(_train_args(demo_train, out, "--checkpoint-every", "5", "--resume", "latest"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    assert [r["step"] for r in metrics(out)] == list(range(1, STEPS + 1))  # no gap, no repeated step
    want, got = weights(uninterrupted), weights(out)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6
    final = "checkpoints/step-00000040"
    tw, tg = _tables(uninterrupted / final), _tables(out / final)
    assert max((tg[k] - tw[k]).abs().max().item() for k in tw) <= 1e-6
    assert [r["loss"] for r in metrics(out)] == pytest.approx(
        [r["loss"] for r in metrics(uninterrupted)], rel=1e-6
    )


def test_sigterm_finishes_the_step_writes_one_checkpoint_and_exits_0(demo_train, uninterrupted, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        toolkit_cmd(*_train_args(demo_train, out)),
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    _wait_for(lambda: (out / "metrics.jsonl").is_file() and len(metrics(out)) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    assert "preempted at step" in output
    steps = [int(p.name.split("-")[1]) for p in (out / "checkpoints").iterdir()]
    assert len(steps) == 1 and steps[0] == max(r["step"] for r in metrics(out)) < STEPS
    assert not (out / "model").exists()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "preempted" and manifest["error"] is None and "traceback" not in manifest
    assert manifest["details"]["preempted"] and manifest["counts"]["step"] == steps[0]
    again = run_cli(_train_args(demo_train, out))  # resume: auto continues the preempted run
    assert again.returncode == 0, again.stderr[-3000:]
    want, got = weights(uninterrupted), weights(out)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6


def test_a_damaged_or_unfinished_newest_checkpoint_is_skipped(demo_train, tmp_path, caplog):
    out = tmp_path / "run"
    cfg = train_cfg(demo_train, out, steps=9, checkpoint={"every_steps": 3})
    run(cfg)
    reference = weights(out)
    ckpts = out / "checkpoints"
    weights_file = ckpts / "step-00000009" / "open_clip_model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:1000])  # truncated
    (ckpts / "step-00000006" / "checkpoint.json").unlink()  # never completed
    with pytest.raises(CheckpointInvalid, match="open_clip_model.safetensors"):
        verify(ckpts / "step-00000009")
    assert latest_valid(str(ckpts)) == str(ckpts / "step-00000003")
    assert "step-00000009" in caplog.text and "open_clip_model.safetensors" in caplog.text
    assert "step-00000006" in caplog.text and "checkpoint.json: missing" in caplog.text
    result = run(train_cfg(demo_train, out, steps=9, checkpoint={"every_steps": 3, "resume": "latest"}))
    assert result.counts["step"] == 9
    for key, value in weights(out).items():
        assert torch.allclose(value, reference[key], rtol=0, atol=1e-6), key


def test_resume_refuses_a_different_configuration(demo_train, tmp_path):
    out = tmp_path / "run"
    run(train_cfg(demo_train, out, steps=2))
    with pytest.raises(
        ValueError,
        match=r"different configuration \(checkpoint -> this run: seed 0 -> 1\); "
        r"resume it with its own config, use --resume none",
    ):
        run(train_cfg(demo_train, out, steps=2, seed=1, checkpoint={"resume": "latest"}))
    run(train_cfg(demo_train, out, steps=2, seed=1, checkpoint={"resume": "none"}))  # starts afresh
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000002"]


def test_refusal_names_the_output_keys_that_differ_with_old_and_new_values():
    from toolkit.train.checkpoint.resume import ConfigMismatch, check_config, output_config, output_hash

    old = train_cfg("data", "out", steps=2, log_every=1)
    saved = {"config_hash": output_hash(old), "config": output_config(old)}
    new = train_cfg("data", "out", steps=3, optim={"lr": 2e-3}, log_every=7, loader={"num_workers": 2})
    with pytest.raises(ConfigMismatch) as refused:
        check_config("ckpt", saved, new)
    message = str(refused.value)
    assert "(checkpoint -> this run: steps 2 -> 3, optim.lr 0.001 -> 0.002); " in message, message
    assert "log_every" not in message and "num_workers" not in message  # affects_output=False: not hashed
    assert "--resume none" in message and "\n" not in message
    check_config(
        "ckpt", saved, train_cfg("data", "elsewhere", steps=2, log_every=9)
    )  # nothing hashed differs
    # a checkpoint written before trainer.json recorded the config: the hashes, as before
    with pytest.raises(
        ConfigMismatch, match=r"different configuration \(config hash [0-9a-f]{16} != [0-9a-f]{16}\)"
    ):
        check_config("ckpt", {"config_hash": output_hash(old)}, new)
    many = train_cfg("d" * 300, "out", model="cliptk-small", batch_size=32, epochs=3, steps=5, seed=4)
    with pytest.raises(ConfigMismatch) as refused:
        check_config("ckpt", saved, many)
    message = str(refused.value)
    assert "data 'data' -> 'ddddddddddddddddddddddddddddddd... (302 characters), model" in message, message
    assert "steps 2 -> 5 and 1 more);" in message and "seed" not in message and len(message) < 400, message


PIPELINE = """
run_dir: {run_dir}
stages:
  - name: train
    kind: train
    config: {{data: "{data}", batch_size: 16, steps: 2, log_every: 1, tensorboard: false,
              loader: {{num_workers: 0}}}}
"""


def test_pipeline_rerun_with_other_steps_names_steps_and_the_pipeline_remedy(demo_train, tmp_path):
    """A user's report: rerunning a pipeline after changing steps failed with a config hash and the CLI's
    --resume none. The refusal (before the two ranks start, as in the quickstart) names the key and the
    --set that starts afresh, keeps the checkpoint, and that --set then works."""
    from typer.testing import CliRunner

    from toolkit.cli.main import app

    path, run_dir = tmp_path / "p.yaml", tmp_path / "run"
    path.write_text(PIPELINE.format(run_dir=run_dir, data=demo_train))

    def pipeline_run(*overrides: str):
        sets = [a for o in overrides for a in ("--set", o)]
        return CliRunner().invoke(app, ["--quiet", "pipeline", "run", str(path), *sets])

    assert (first := pipeline_run()).exit_code == 0, first.output
    refused = pipeline_run("stages.train.steps=3", "stages.train.launch.nproc_per_node=2")
    assert refused.exit_code == 1, refused.output
    line = refused.output.strip().splitlines()[-1]
    assert "(checkpoint -> this run: steps 2 -> 3)" in line, refused.output
    assert "--set stages.train.checkpoint.resume=none" in line and f"moving {run_dir}/train away" in line
    assert "--resume none" not in line
    assert (run_dir / "train" / "checkpoints" / "step-00000002" / "checkpoint.json").is_file()
    afresh = pipeline_run("stages.train.steps=3", "stages.train.checkpoint.resume=none")
    assert afresh.exit_code == 0, afresh.output
    assert [p.name for p in (run_dir / "train" / "checkpoints").iterdir()] == ["step-00000003"]
    assert "train: skipped" in pipeline_run("stages.train.steps=3").output  # resume is not part of the hash


@pytest.mark.parametrize("schedule", ["step_thresh", "const"])
def test_resume_keeps_the_tau_lr_rule(demo_train, tmp_path, schedule):
    """τ's own lr rules set the logit-scale group's lr every step; torch's Optimizer.load_state_dict replaces
    the group dicts, and the rule once went on setting a stale one (the resumed run kept the checkpoint's τ
    lr: logit scale 2.01 vs 0.92 uninterrupted with step_thresh). Resumed at step 2 of 4 under SGD, the
    weights equal the uninterrupted run's."""
    import shutil

    loss = {
        "kind": "openclip",
        "mode": "gather",
        "learn_tau": True,
        "lr_tau": 0.5,
        "lr_tau_schedule": schedule,
        "tau_init": 0.03,
    }  # starts at step_thresh's 0.03 threshold: its lr changes as τ moves
    common = {
        "loss": loss,
        "optim": {"name": "sgd", "lr": 0.05, "warmup_steps": 0},
        "steps": 4,
        "checkpoint": {"every_steps": 2, "keep": 5},
    }
    run(train_cfg(demo_train, tmp_path / "a", **common))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "step-00000004")
    shutil.rmtree(tmp_path / "b" / "model")
    result = run(train_cfg(demo_train, tmp_path / "b", **common))
    assert result.counts["step"] == 4
    want, got = weights(tmp_path / "a"), weights(tmp_path / "b")
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6
