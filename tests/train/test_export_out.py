"""toolkit export --out never replaces what export did not write: the run, the runs folder, a user's
folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainkit import run_cli

from toolkit.core.pathguard import OutputIsInput
from toolkit.train.export import ExportConfig, check_out, run


def _finished_run(runs: Path) -> Path:
    """A run folder as train leaves it (manifest done, model/, checkpoints); only its books, no weights."""
    run_dir = runs / "run"
    (run_dir / "model").mkdir(parents=True)
    (run_dir / "model" / "open_clip_config.json").write_text("{}")
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "step-2").write_text("weights")
    (run_dir / "manifest.json").write_text(json.dumps({"kind": "train", "status": "done", "config": {}}))
    (runs / "other-run").mkdir()
    (runs / "other-run" / "metrics.jsonl").write_text("{}\n")
    return run_dir


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("where", ["run", "runs", "run/model", "user"])
def test_export_refuses_an_out_it_would_destroy(tmp_path, where):
    runs = tmp_path / "runs"
    run_dir = _finished_run(runs)
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "thesis.tex").write_text("years of work")
    before = _tree(tmp_path)
    out = {"run": run_dir, "runs": runs, "run/model": run_dir / "model", "user": tmp_path / "user"}[where]
    with pytest.raises((OutputIsInput, ValueError)) as err:
        run(ExportConfig(run=str(run_dir), out=str(out)))
    assert str(out) in str(err.value)
    assert _tree(tmp_path) == before


def test_export_out_may_be_new_empty_or_an_earlier_export(tmp_path):
    run_dir = _finished_run(tmp_path / "runs")
    check_out(run_dir, tmp_path / "new")
    (tmp_path / "empty").mkdir()
    check_out(run_dir, tmp_path / "empty")
    earlier = tmp_path / "shared"
    earlier.mkdir()
    (earlier / "open_clip_model.safetensors").write_bytes(b"x")
    (earlier / "model_card.json").write_text(
        json.dumps({"weights": "raw", "dataset": {}, "training": {}, "toolkit_version": "0"})
    )
    check_out(run_dir, earlier)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        check_out(run_dir, tmp_path / "afile")


def test_export_cli_refusal_is_one_line_exit_2(tmp_path):
    run_dir = _finished_run(tmp_path / "runs")
    result = run_cli(["export", str(run_dir), "--out", str(run_dir)], timeout_s=120)
    assert result.returncode == 2, result.stderr
    assert "must differ from input run" in result.stderr and "Traceback" not in result.stderr
    assert (run_dir / "checkpoints" / "step-2").read_text() == "weights"
