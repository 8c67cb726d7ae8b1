"""Resolution and text-length stages (train/stages.py, models/resolution.py): the plan, the ViT at another
resolution, CLIPA's text cut, and training: lr per stage, exact resume mid-stage and across a switch."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
import torch
from torch.nn import functional as F
from trainkit import ROOT, env, metrics, run_cli, run_one_thread, toolkit_cmd, train_cfg, weights

from toolkit.models.factory import build_model, resolve_spec
from toolkit.models.resolution import allow_any_resolution, resize_patch_table, shorten_tokens
from toolkit.train.run import run
from toolkit.train.stages import parse, schedule


def test_the_plan_covers_every_step_once_and_bad_plans_are_named():
    stages = schedule(parse("112px,16tok:0.9;224px:0.1"), 25)
    assert [(s.image_px, s.text_tokens, s.start, s.stop) for s in stages] == [
        (112, 16, 0, 22),
        (224, 0, 22, 25),
    ]
    assert [(s.image_px, s.text_tokens) for s in parse(":0.5; 16tok :0.5")] == [(0, 0), (0, 16)]
    for bad, words in [
        ("112px", "FRACTION"),
        ("112px:0.5;:0.4", "sum to 0.9"),
        ("112pix:1", "112pix"),
        ("112px:x", "not a number"),
        ("112px:0", r"\(0, 1\]"),
    ]:
        with pytest.raises(ValueError, match=words):
            parse(bad)


def _clip():
    torch.manual_seed(0)
    return build_model(resolve_spec("cliptk-tiny").model_cfg).eval()


def test_the_vit_runs_at_its_own_resolution_unchanged_and_at_half_with_a_bicubic_table():
    clip, pixels = _clip(), torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = clip.encode_image(pixels)
        allow_any_resolution(clip)
        assert torch.equal(clip.encode_image(pixels), want)
    table = clip.visual.positional_embedding  # [1 + 64, w]
    half = resize_patch_table(table, 4)
    grid = table[1:].reshape(1, 8, 8, -1).permute(0, 3, 1, 2)
    manual = (
        F.interpolate(grid, size=(4, 4), mode="bicubic", align_corners=False)
        .permute(0, 2, 3, 1)
        .reshape(16, -1)
    )
    assert torch.equal(half[0], table[0]) and torch.allclose(half[1:], manual)
    clip.visual.positional_embedding.grad = None
    clip.encode_image(torch.randn(2, 3, 16, 16)).sum().backward()  # 16 px: a 4 x 4 grid
    assert clip.visual.positional_embedding.grad[1:].abs().sum() > 0  # through the interpolation


def test_text_is_cut_to_first_tokens_and_end_of_text_or_a_seeded_subset():
    eot = 99
    tokens = torch.tensor([[1, 10, 11, 12, 13, 14, eot, 0], [1, 20, eot, 0, 0, 0, 0, 0]])
    first = shorten_tokens(tokens, 4, "argmax", None)
    assert first.tolist() == [[1, 10, 11, eot], [1, 20, eot, 0]]
    ids = torch.tensor([5, 6])
    rnd = shorten_tokens(tokens, 4, "argmax", None, "random", seed=3, ids=ids)
    assert rnd[1].tolist() == [1, 20, eot, 0] and rnd[0, 0] == 1 and rnd[0, 3] == eot
    middle = rnd[0, 1:3].tolist()
    assert middle == sorted(middle) and set(middle) <= {10, 11, 12, 13, 14}
    assert torch.equal(shorten_tokens(tokens, 4, "argmax", None, "random", seed=3, ids=ids), rnd)
    draws = {
        tuple(shorten_tokens(tokens, 4, "argmax", None, "random", seed=s, ids=ids)[0].tolist())
        for s in range(20)
    }
    assert len(draws) > 3  # other steps draw other subsets
    assert torch.equal(shorten_tokens(tokens, 8, "argmax", None), tokens)


STEPS = 24
PLAN = ["--stages", "16px,8tok:0.5;:0.5", "--set", "stage_lr=stage", "--set", "stage_text=random"]


def _args(data, out, *extra: str) -> list[str]:
    return [
        "train",
        "--data",
        str(data),
        "--out",
        str(out),
        "--steps",
        str(STEPS),
        "--batch-size",
        "16",
        "--workers",
        "0",
        "--log-every",
        "1",
        "--set",
        "tensorboard=false",
        "--loss",
        "fastclip-v3",
        "--set",
        "optim.warmup_steps=3",
        "--checkpoint-every",
        "4",
        *PLAN,
        *extra,
    ]


@pytest.fixture(scope="module")
def whole(demo_train, tmp_path_factory):
    """The uninterrupted run of _args' training, in this process at the commands' one thread."""
    out = tmp_path_factory.mktemp("stages") / "whole"
    run_one_thread(
        train_cfg(
            demo_train,
            out,
            steps=STEPS,
            batch_size=16,
            optim={"warmup_steps": 3},
            checkpoint={"every_steps": 4},
            stages="16px,8tok:0.5;:0.5",
            stage_lr="stage",
            stage_text="random",
        )
    )
    return out


def test_the_lr_restarts_per_stage_and_the_stage_changes_training(demo_train, whole, tmp_path):
    lrs = [r["lr"] for r in metrics(whole)]
    assert lrs[12:15] == pytest.approx(lrs[0:3])  # warmup again at the switch (step 13 of 24)
    run(train_cfg(demo_train, tmp_path / "plain", steps=2, batch_size=16))
    first = metrics(whole)[0]["loss"]
    assert first != pytest.approx(metrics(tmp_path / "plain")[0]["loss"], rel=1e-6)


def _killed_after(args: list[str], out, step: int) -> None:
    """Start ``toolkit train ARGS`` and SIGKILL it once its checkpoint of ``step`` is complete."""
    proc = subprocess.Popen(
        toolkit_cmd(*args), cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        start = time.monotonic()
        while not (out / "checkpoints" / f"step-{step:08d}" / "checkpoint.json").is_file():
            assert proc.poll() is None and time.monotonic() - start < 240, (
                f"run ended before the kill at {step}"
            )
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert max(r["step"] for r in metrics(out)) < STEPS, "the job finished before the kill"


def test_kill_and_resume_equals_the_uninterrupted_staged_run(demo_train, whole, tmp_path):
    """Killed mid first stage (after step 8), resumed, killed again in the second stage (after step 16, past
    the switch at 13), resumed to the end: both resumes in one chain (3 launches where two separate runs took
    4), ending with the uninterrupted run's weights and losses."""
    out = tmp_path / "run"
    _killed_after(_args(demo_train, out), out, 8)
    _killed_after(_args(demo_train, out, "--resume", "latest"), out, 16)
    resumed = run_cli(_args(demo_train, out, "--resume", "latest"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr + resumed.stdout
    assert [r["step"] for r in metrics(out)] == list(range(1, STEPS + 1))
    want, got = weights(whole), weights(out)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6
    assert [r["loss"] for r in metrics(out)] == pytest.approx([r["loss"] for r in metrics(whole)], rel=1e-6)


@pytest.mark.dist
def test_two_ranks_train_the_staged_run_of_one_process(demo_train, tmp_path):
    """Random caption subsets and the resolution switch follow the step and the sample ids, not the rank. The
    one-process run trains in this process (the same flags as config keys, at the commands' one thread)."""
    args = ["--steps", "4", "--set", "optim.name=sgd", "--set", "optim.lr=0.1", "--checkpoint-every", "0"]
    run_one_thread(
        train_cfg(
            demo_train,
            tmp_path / "one",
            steps=4,
            batch_size=16,
            optim={"name": "sgd", "lr": 0.1, "warmup_steps": 3},
            checkpoint={"every_steps": 0},
            stages="16px,8tok:0.5;:0.5",
            stage_lr="stage",
            stage_text="random",
        )
    )
    two = run_cli(
        [
            *_args(demo_train, tmp_path / "two"),
            *args,
            "--stages",
            "16px,8tok:0.5;:0.5",
            "--nproc-per-node",
            "2",
            "--micro-batch-size",
            "3",
        ]
    )
    assert two.returncode == 0, two.stderr[-3000:]
    assert [r["loss"] for r in metrics(tmp_path / "two")] == pytest.approx(
        [r["loss"] for r in metrics(tmp_path / "one")], rel=1e-5
    )
    want, got = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-5


PIPELINE = """
run_dir: {run_dir}
stages:
  - name: train
    kind: train
    config: {{data: "{data}", batch_size: 16, steps: 4, log_every: 1, tensorboard: false,
              loader: {{num_workers: 0}}, patch_dropout: 0.5, stages: "16px,8tok:0.5;:0.5",
              stage_text: random, launch: {{nproc_per_node: 2}}}}
"""


@pytest.mark.dist
def test_both_levers_train_through_a_pipeline_stage_on_two_ranks(demo_train, tmp_path):
    from typer.testing import CliRunner

    from toolkit.cli.main import app

    path, run_dir = tmp_path / "p.yaml", tmp_path / "run"
    path.write_text(PIPELINE.format(run_dir=run_dir, data=demo_train))
    result = CliRunner().invoke(app, ["--quiet", "pipeline", "run", str(path)])
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in metrics(run_dir / "train")] == [1, 2, 3, 4]
    assert (run_dir / "train" / "model" / "open_clip_model.safetensors").is_file()
    import yaml

    written = yaml.safe_load((run_dir / "train" / "config.yaml").read_text())
    assert (written["patch_dropout"], written["stages"], written["launch"]["nproc_per_node"]) == (
        0.5,
        "16px,8tok:0.5;:0.5",
        2,
    )
