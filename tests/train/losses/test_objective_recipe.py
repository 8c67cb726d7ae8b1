"""docs/architecture.md's "Adding an objective" runs as written: a copy of toolkit/ gets the recipe's three
files (taken from the doc's code block, verbatim), its one line of ``registry.py`` and its section in
``losses/config.py``; then ``toolkit train --loss plain`` trains a step without a mode flag (the objective
runs in the gather mode only) and ``toolkit --help`` names it among the objectives."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from trainkit import MODEL, ROOT

HEADER = re.compile(r"^# (toolkit/train/losses/\S+)(.*)$")


def recipe_blocks() -> dict[str, str]:
    """{path the doc names: the lines under its header} of the recipe's code block."""
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = doc[doc.index("### Adding an objective") :]
    start = section.index("```python\n") + len("```python\n")
    block = section[start : section.index("\n```", start)]
    blocks: dict[str, list[str]] = {}
    current = None
    for line in block.splitlines():
        match = HEADER.match(line)
        if match:
            current = match.group(1).rstrip(":")
            blocks[current] = []
        elif current is not None:
            blocks[current].append(line)
    return {path: "\n".join(lines).strip("\n") + "\n" for path, lines in blocks.items()}


def apply_recipe(tree: Path) -> None:
    """The recipe on the copy ``tree`` of the repository: the folder's files, the registry's line, the
    section."""
    blocks = recipe_blocks()
    folder = tree / "toolkit/train/losses/plain"
    folder.mkdir()
    (folder / "__init__.py").write_text('"""The plain CLIP objective (docs/architecture.md\'s recipe)."""\n')
    for name in ("loss.py", "config.py", "spec.py"):
        (folder / name).write_text(blocks[f"toolkit/train/losses/plain/{name}"])
    registry = tree / "toolkit/train/losses/registry.py"
    line = blocks["toolkit/train/losses/registry.py"].strip()
    assert line == 'OBJECTIVES = (..., "toolkit.train.losses.plain")', line
    text = registry.read_text()
    last = '    "toolkit.train.losses.distill",\n)'  # the tuple's last entry, as the formatter writes it
    assert last in text
    registry.write_text(
        text.replace(last, '    "toolkit.train.losses.distill",\n    "toolkit.train.losses.plain",\n)')
    )
    config = tree / "toolkit/train/losses/config.py"
    import_line, field_line = [
        line for line in blocks["toolkit/train/losses/config.py"].splitlines() if not line.startswith("#")
    ]
    text = config.read_text()
    anchor = "from toolkit.train.losses.siglip.config import SigLIPConfig\n"
    text = text.replace(anchor, anchor + import_line + "\n")
    anchor = "    moved_keys: ClassVar"
    config.write_text(text.replace(anchor, field_line + "\n" + anchor))


def test_the_documented_recipe_trains_an_objective(demo_train, tmp_path):
    tree = tmp_path / "repo"
    shutil.copytree(ROOT / "toolkit", tree / "toolkit", ignore=shutil.ignore_patterns("__pycache__"))
    apply_recipe(tree)
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "disabled",
    }

    def toolkit(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "toolkit", *args],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    help_text = " ".join(toolkit("train", "--help").stdout.split())  # the root help cuts it to 45 characters
    assert "plain CLIP" in help_text, help_text
    out = tmp_path / "run"
    result = toolkit(
        "train",
        "--data",
        str(demo_train),
        "--out",
        str(out),
        "--loss",
        "plain",
        "--model",
        MODEL,
        "--batch-size",
        "16",
        "--steps",
        "1",
        "--workers",
        "0",
        "--set",
        "tensorboard=false",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{out}: 1 steps" in result.stdout
    recorded = (out / "config.yaml").read_text()
    assert "kind: plain" in recorded and "mode: gather" in recorded
    assert (out / "model" / "open_clip_model.safetensors").is_file()
