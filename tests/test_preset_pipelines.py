"""pipelines/presets/*.yaml: each validates, plans (--dry-run), and runs scaled down on local data.

The scaled-down copy keeps every stage and the preset's objective; what changes is the size: URL lists in
the published format (CC3M: caption<TAB>url without header, CC12M: url<TAB>caption without header, LAION:
parquet with URL and TEXT) pointing at demo PNGs served on 127.0.0.1, cliptk-tiny instead of the preset's
model, two training steps on one CPU process, and a three-class folder for the zero-shot stage.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from toolkit.cli.main import app

PRESETS = Path(__file__).resolve().parents[1] / "pipelines" / "presets"
NAMES = ("cc3m", "cc12m", "laion")


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[Path, list[tuple[str, str]]]:
    """The demo's first 24 Twemoji PNGs: (demo folder, [(path relative to it, caption)])."""
    import csv

    from toolkit.core.config import build
    from toolkit.data.acquire import demo as demo_stage

    root = tmp_path_factory.mktemp("preset_demo")
    result = demo_stage.run(build(demo_stage.DemoConfig, {"out": str(root), "limit": 24}))
    with open(result.outputs["train_csv"], newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    base = Path(result.outputs["train_csv"]).parent
    pairs = [(str((base / r["path"]).resolve().relative_to(root.resolve())), r["caption"]) for r in rows]
    return root, pairs


def _url_list(name: str, folder: Path, url: str, pairs: list[tuple[str, str]]) -> Path:
    if name == "laion":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = folder / "part-00000.parquet"
        pq.write_table(pa.table({"URL": [url + p for p, _ in pairs], "TEXT": [c for _, c in pairs]}), path)
        return path
    path = folder / ("Train_GCC-training.tsv" if name == "cc3m" else "cc12m.tsv")
    rows = [f"{c}\t{url}{p}" if name == "cc3m" else f"{url}{p}\t{c}" for p, c in pairs]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def _eval_folder(root: Path, demo_root: Path, pairs: list[tuple[str, str]]) -> tuple[Path, Path]:
    """Three classes of three images each, and their class-name file."""
    folder = root / "eval_folder"
    for i, (path, _) in enumerate(pairs[:9]):
        (folder / f"class{i % 3}").mkdir(parents=True, exist_ok=True)
        shutil.copy(demo_root / path, folder / f"class{i % 3}" / f"{i}.png")
    names = root / "classnames.txt"
    names.write_text("smiley\nanimal\nobject\n")
    return folder, names


@pytest.mark.parametrize("name", NAMES)
def test_preset_pipeline_validates_and_plans(name):
    path = str(PRESETS / f"{name}.yaml")
    assert CliRunner().invoke(app, ["pipeline", "validate", path]).exit_code == 0
    planned = CliRunner().invoke(app, ["pipeline", "run", path, "--dry-run"])
    assert planned.exit_code == 0, planned.output
    assert "train" in planned.output and "zeroshot" in planned.output


@pytest.mark.parametrize("name", NAMES)
def test_preset_pipeline_runs_scaled_down(name, demo, tmp_path):
    from toolkit.data.acquire.serve import serve

    demo_root, pairs = demo
    eval_folder, classnames = _eval_folder(tmp_path, demo_root, pairs)
    with serve(str(demo_root)) as server:
        urls = _url_list(name, tmp_path, server.url, pairs)
        sets = {
            "run_dir": str(tmp_path / "run"),
            "vars.url_list": str(urls),
            "vars.model": "cliptk-tiny",
            "vars.image_size": 64,
            "vars.num_processes": 1,
            "vars.num_threads": 4,
            "vars.nproc_per_node": 1,
            "vars.device": "cpu",
            "vars.eval_folder": str(eval_folder),
            "vars.eval_classnames": str(classnames),
            "stages.train.batch_size": 8,
            "stages.train.steps": 2,
            "stages.train.loader.num_workers": 0,
            "stages.train.tensorboard": "false",
        }
        args = [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]
        result = CliRunner().invoke(app, ["--quiet", "pipeline", "run", str(PRESETS / f"{name}.yaml"), *args])
    assert result.exit_code == 0, result.output
    run = tmp_path / "run"
    fetched = json.loads((run / "raw" / "manifest.json").read_text())
    assert fetched["status"] == "done" and fetched["counts"]["num_success"] == len(pairs), fetched["counts"]
    trained = json.loads((run / "train" / "manifest.json").read_text())
    assert trained["status"] == "done" and (run / "train" / "model" / "open_clip_model.safetensors").is_file()
    assert (run / "zeroshot" / "results.json").is_file()
