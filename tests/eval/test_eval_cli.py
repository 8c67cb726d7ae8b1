"""`toolkit eval build-set` and `toolkit eval zeroshot` through Typer's CliRunner on a saved cliptk-tiny."""

from __future__ import annotations

import json

import pytest
from evalkit import make_caption_csv, make_folder
from typer.testing import CliRunner

from toolkit.cli.main import app
from toolkit.eval import report


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A cliptk-tiny checkpoint written by save_model, and a classification + a retrieval set via the CLI."""
    from toolkit.models import load_model, save_model

    tmp = tmp_path_factory.mktemp("cli")
    loaded = load_model("cliptk-tiny", seed=0)
    save_model(loaded.model, loaded.model_cfg, tmp / "ckpt")
    runner = CliRunner()
    make_folder(tmp / "folder", [2, 1, 2, 1, 2, 1])
    make_caption_csv(tmp / "csv", 7)
    for args in (
        ["--source", "folder", "--input", str(tmp / "folder"), "--out", str(tmp / "sets" / "six")],
        [
            "--source",
            "csv",
            "--task",
            "retrieval",
            "--input",
            str(tmp / "csv" / "pairs.csv"),
            "--out",
            str(tmp / "sets" / "pairs"),
        ],
    ):
        result = runner.invoke(app, ["eval", "build-set", *args])
        assert result.exit_code == 0, result.output
        assert "evaluate with: toolkit eval zeroshot --root" in result.output
        # issue 15 item 19: a retrieval set was summarised as '7 samples, 0 classes'
        assert ("7 retrieval pairs" if "retrieval" in args else "9 samples in 6 classes") in result.output
    return tmp


def test_zeroshot_cli_on_checkpoint(workspace):
    out = workspace / "run"
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "zeroshot",
            "--model",
            str(workspace / "ckpt"),
            "--datasets",
            "six,pairs",
            "--root",
            str(workspace / "sets"),
            "--out",
            str(out),
            "--batch-size",
            "3",
            "--device",
            "cpu",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "| six | 9 |" in result.output and "| pairs | 7 |" in result.output
    data = report.read_results(str(out / "results.json"))
    assert [r["dataset"] for r in data["results"]] == ["wds/six", "wds/pairs"]
    assert [r["task"] for r in data["results"]] == ["zeroshot_classification", "zeroshot_retrieval"]
    assert data["results"][0]["model"] == "ckpt" and data["results"][0]["pretrained"].endswith(".safetensors")
    metrics = data["results"][0]["metrics"]
    assert set(metrics) == {"acc1", "acc5", "mean_per_class_recall"} and 0 <= metrics["acc1"] <= 1
    assert data["results"][1]["metrics"]["text_retrieval_recall@10"] is None  # 7 images < 10
    per_dataset = json.loads((out / "per_dataset" / "pairs_zeroshot_retrieval.json").read_text())
    assert per_dataset == data["results"][1]
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "done" and manifest["kind"] == "eval.zeroshot"
    assert manifest["counts"]["num_samples"] == {"six": 9, "pairs": 7}
    assert set(manifest["outputs"]) >= {"results", "report"}


def test_zeroshot_cli_writes_to_an_fsspec_url(workspace):
    import fsspec

    out = "memory://cliptk-eval-cli/run"
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "zeroshot",
            "--model",
            str(workspace / "ckpt"),
            "--datasets",
            "six",
            "--root",
            str(workspace / "sets"),
            "--set",
            f"out={out}",
            "--batch-size",
            "4",
            "--device",
            "cpu",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "| six | 9 |" in result.output and f"results: {out}/results.json" in result.output
    fs = fsspec.filesystem("memory")
    assert fs.cat(f"{out}/results.png")[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(fs.cat(f"{out}/manifest.json"))["status"] == "done"


def test_zeroshot_cli_errors(workspace):
    runner = CliRunner()
    result = runner.invoke(
        app,
        [
            "eval",
            "zeroshot",
            "--model",
            str(workspace / "ckpt"),
            "--datasets",
            "six,nope",
            "--root",
            str(workspace / "sets"),
            "--out",
            str(workspace / "bad"),
        ],
    )
    assert result.exit_code == 1
    assert "nope: dataset directory not found" in result.output
    result = runner.invoke(
        app,
        [
            "eval",
            "zeroshot",
            "--datasets",
            "six",
            "--root",
            str(workspace / "sets"),
            "--out",
            str(workspace / "bad"),
        ],
    )
    assert result.exit_code == 2 and "model: missing required value" in result.output


@pytest.mark.parametrize("name", ["../../six", "/abs/six", "..", "a\\b"])
def test_zeroshot_dataset_name_is_not_a_path(workspace, name):
    """Issue 15 item 14: sets/deep/er/../../six was evaluated and its JSON written outside --out."""
    (workspace / "sets" / "deep" / "er").mkdir(parents=True, exist_ok=True)
    out = workspace / "escape" / "out"
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "zeroshot",
            "--model",
            str(workspace / "ckpt"),
            "--datasets",
            name,
            "--root",
            str(workspace / "sets" / "deep" / "er"),
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 2, result.output
    assert "is not a set name" in result.output and "datasets" in result.output
    assert not (workspace / "escape").exists()


def test_pipeline_kinds_registered():
    from toolkit.pipeline.kinds import KINDS

    assert {"results", "report"} <= set(KINDS["eval.zeroshot"].outputs)
    assert KINDS["eval.build-set"].load("run").__module__ == "toolkit.eval.build"
    assert KINDS["eval.zeroshot"].load("config").__name__ == "ZeroShotConfig"


def test_help_lists_every_option():
    result = CliRunner().invoke(app, ["eval", "zeroshot", "--help"])
    assert result.exit_code == 0
    for option in (
        "--model",
        "--datasets",
        "--root",
        "--out",
        "--weights",
        "--batch-size",
        "--workers",
        "--device",
        "--amp",
        "--precision",
    ):
        assert option in result.output


def test_pipeline_builds_then_evaluates(workspace, tmp_path):
    from toolkit.pipeline.load import load_pipeline
    from toolkit.pipeline.runner import run_pipeline

    (tmp_path / "p.yaml").write_text(f"""
run_dir: {tmp_path / "run"}
stages:
  - name: pairs
    kind: eval.build-set
    config: {{source: csv, task: retrieval, input: {workspace / "csv" / "pairs.csv"},
             out: "${{run_dir}}/sets/pairs"}}
  - name: zeroshot
    kind: eval.zeroshot
    config: {{model: {workspace / "ckpt"}, root: "${{stages.pairs.outputs.root}}",
             datasets: ["${{stages.pairs.outputs.name}}"], device: cpu, recall_k: [1, 2]}}
""")
    report_ = run_pipeline(load_pipeline(str(tmp_path / "p.yaml")))
    assert [action for _, action, _ in report_] == ["ran", "ran"]
    data = report.read_results(report_[1][2].outputs["results"])
    assert set(data["results"][0]["metrics"]) == {
        f"{d}_retrieval_recall@{k}" for d in ("image", "text") for k in (1, 2)
    }
    again = run_pipeline(load_pipeline(str(tmp_path / "p.yaml")))
    assert [action for _, action, _ in again] == ["skipped", "skipped"]
