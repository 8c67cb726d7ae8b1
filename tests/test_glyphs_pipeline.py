"""pipelines/glyphs.yaml: it plans, and a scaled-down copy runs the whole chain (60 characters that at
least 12 styles draw, 3 steps from random init): the glyph set, the training list without the held-out
and validation styles, shards, precompute, the held-out retrieval set, training with the default
objective and the zero-shot score of the held-out style."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from typer.testing import CliRunner

from toolkit.cli.main import app

GLYPHS = Path(__file__).resolve().parents[1] / "pipelines" / "glyphs.yaml"


def test_glyphs_pipeline_plans():
    planned = CliRunner().invoke(app, ["pipeline", "run", str(GLYPHS), "--dry-run"])
    assert planned.exit_code == 0, planned.output
    for stage in ("glyphs", "train_list", "shard", "precompute", "heldout_set", "train", "zeroshot"):
        assert stage in planned.output


def test_glyphs_pipeline_runs_scaled_down(tmp_path):
    run_dir = tmp_path / "glyphs"
    sets = {
        "run_dir": str(run_dir),
        "vars.min_fonts": 12,
        "stages.glyphs.limit": 60,
        "vars.heldout": "DejaVuSansMono",
        "vars.batch_size": 16,
        "vars.epochs": 1,
        "stages.train.steps": 3,
        "stages.train.optim.warmup_steps": 1,
        "stages.train.eval.every_steps": 0,
        "stages.precompute.num_workers": 1,
    }
    args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    result = CliRunner().invoke(app, ["--quiet", "pipeline", "run", str(GLYPHS), *args])
    assert result.exit_code == 0, result.output
    with (run_dir / "train_list" / "train.csv").open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    styles = {Path(r["path"]).parent.name for r in rows}
    assert len(styles) == 14 and not styles & {"DejaVuSansMono", "DejaVuSerif-BoldItalic"}
    assert all(Path(r["path"]).is_file() for r in rows)
    assert json.loads((run_dir / "precompute" / "dataset.json").read_text())["num_samples"] == len(rows)
    train = json.loads((run_dir / "train" / "manifest.json").read_text())
    assert train["status"] == "done" and train["counts"]["step"] == 3
    results = json.loads((run_dir / "zeroshot" / "results.json").read_text())["results"]
    metrics = next(r["metrics"] for r in results if r["dataset"] == "wds/heldout")
    assert 0 <= metrics["image_retrieval_recall@1"] <= metrics["image_retrieval_recall@10"] <= 1


def test_glyphs_pipeline_names_a_missing_heldout_style(tmp_path):
    sets = {"run_dir": str(tmp_path / "g"), "stages.glyphs.limit": 20, "vars.heldout": "NoSuchFont"}
    args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
    result = CliRunner().invoke(app, ["--quiet", "pipeline", "run", str(GLYPHS), *args])
    assert result.exit_code != 0
    assert "NoSuchFont" in result.output
