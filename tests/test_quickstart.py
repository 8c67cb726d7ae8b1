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


def test_quickstart_end_to_end_small(tmp_path):
    """The whole chain at a small size: HTTP serve + fetch, precompute, FastCLIP-v3 training by 2 processes,
    evaluation of the random init and the trained model; a rerun skips every stage but the server."""
    from _launch import free_port

    path = PIPELINES[[p.name for p in PIPELINES].index("quickstart.yaml")]
    args = ["--quiet", "pipeline", "run", str(path), "--set", f"run_dir={tmp_path}", "--set", "vars.num_concepts=400",
            "--set", f"vars.port={free_port()}", "--set", "vars.steps=120"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    folders = {"demo": "demo", "fetch": "raw", "precompute": "precompute", "retrieval_set": "evalsets/openmoji_retrieval",
               "groups_set": "evalsets/openmoji_groups", "fashion_set": "evalsets/fashion_mnist",
               "baseline": "baseline", "train": "train", "zeroshot": "zeroshot"}
    for name, folder in folders.items():
        assert json.loads((tmp_path / folder / "manifest.json").read_text())["status"] == "done", name
    precompute = json.loads((tmp_path / "precompute" / "manifest.json").read_text())
    assert precompute["counts"]["num_samples"] == 400
    trained, untrained = _mean_r10(tmp_path / "zeroshot"), _mean_r10(tmp_path / "baseline")
    assert trained > untrained, (trained, untrained)
    assert "| chance |" in result.output  # the results table is printed
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert all(f"{name}: skipped" in again.output for name in folders), again.output
    assert "serve: ran" in again.output
