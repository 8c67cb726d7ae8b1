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


def test_quickstart_end_to_end_small(tmp_path):
    path = PIPELINES[[p.name for p in PIPELINES].index("quickstart.yaml")]
    args = ["--quiet", "pipeline", "run", str(path), "--set", f"run_dir={tmp_path}", "--set", "vars.num_concepts=27"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    precompute = json.loads((tmp_path / "precompute" / "manifest.json").read_text())
    assert precompute["status"] == "done" and precompute["counts"]["num_samples"] == 27
    results = json.loads((tmp_path / "zeroshot" / "results.json").read_text())
    assert {r["dataset"] for r in results["results"]} == {"wds/openmoji_retrieval", "wds/openmoji_groups"}
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0 and again.output.count("skipped") == 7
