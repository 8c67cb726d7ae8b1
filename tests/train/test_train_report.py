"""What a training run reports while and after it runs (issue 43 item 23): samples/s without evaluation time,
progress lines with a time estimate, no raw progress bars from in-training evaluation, the scores printed at
the end, and reports that name the model by its run."""

from __future__ import annotations

import json
import logging
import re
import time

from trainkit import metrics, run_cli, train_cfg

from toolkit.train import report as report_module
from toolkit.train.metrics import Progress, read_metrics
from toolkit.train.run import run

EVAL_SECONDS = 1000.0  # what each evaluation adds to the reporter's clock: no real step takes this long


class _Clock:
    """time.monotonic as report.py sees it, pushed forward by the evaluation callback (no real waiting)."""

    def __init__(self):
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset


def test_samples_per_s_leaves_out_evaluation_time(demo_train, tmp_path, monkeypatch):
    """The quickstart logged 38 samples/s after each in-training evaluation and ~5,000 otherwise."""
    clock = _Clock()
    monkeypatch.setattr(report_module, "time", clock)

    def evaluate(clip, model_cfg, preprocess_cfg, step):
        clock.offset += EVAL_SECONDS
        return {"eval/fake/acc1": step / 10}

    out = tmp_path / "run"
    cfg = train_cfg(
        demo_train,
        out,
        steps=6,
        log_every=2,
        eval={"every_steps": 2, "root": str(tmp_path), "datasets": ["fake"]},
    )
    run(cfg, evaluate)
    rows = [r for r in metrics(out) if "step_time_s" in r]
    assert [r["step"] for r in rows] == [2, 4, 6]
    for r in rows:
        assert r["step_time_s"] < EVAL_SECONDS / 10 and r["samples_per_s"] > 16 * 2 / EVAL_SECONDS, r
    assert [r["eval/fake/acc1"] for r in read_metrics(str(out)) if "eval/fake/acc1" in r] == [0.2, 0.4, 0.6]


def test_progress_lines_carry_a_time_estimate(caplog):
    progress = Progress(total_steps=300, start_step=0)  # off a TTY (pytest captures stderr): log lines
    progress.last_log = float("-inf")
    with caplog.at_level(logging.INFO, logger="toolkit.train"):
        progress.update(100, 0.5, 64.0, step_time_s=0.5)
    assert "step 100/300: loss 0.5000  64 samples/s  eta 1m40s" in caplog.text, caplog.text


def test_train_prints_its_scores_and_no_raw_bars_and_the_report_names_the_run(demo_train, tmp_path):
    from toolkit.core.config import build
    from toolkit.eval import build as build_set
    from toolkit.eval import zeroshot

    sets = tmp_path / "sets"
    build_set.run(
        build(
            build_set.BuildSetConfig,
            {
                "source": "openmoji",
                "task": "retrieval",
                "input": str(demo_train.parent / "demo"),
                "out": str(sets / "om"),
                "limit": 40,
            },
        )
    )
    out = tmp_path / "my-run"
    proc = run_cli(
        [
            "train",
            "--data",
            str(demo_train),
            "--out",
            str(out),
            "--steps",
            "4",
            "--batch-size",
            "16",
            "--workers",
            "0",
            "--eval-every",
            "2",
            "--eval-root",
            str(sets),
            "--eval-datasets",
            "om",
            "--set",
            "tensorboard=false",
        ]
    )
    assert proc.returncode == 0, proc.stderr
    assert not re.search(r"it/s\]|\d+%\|", proc.stderr), proc.stderr  # clip-benchmark's tqdm bars
    assert f"zero-shot scores at step 4 (also in {out}/metrics.jsonl):" in proc.stdout, proc.stdout
    assert re.search(r"^  om: .*image_retrieval_recall@1 \d\.\d{4}", proc.stdout, re.M), proc.stdout

    result = zeroshot.run(
        build(
            zeroshot.ZeroShotConfig,
            {
                "model": str(out / "model"),
                "datasets": ["om"],
                "root": str(sets),
                "out": str(tmp_path / "z"),
                "device": "cpu",
            },
        )
    )
    assert result.details["model"] == "my-run"
    assert json.loads((tmp_path / "z" / "results.json").read_text())["model"] == "my-run"
    assert (tmp_path / "z" / "report.md").read_text().startswith("# Zero-shot evaluation: my-run\n")
