"""Imports point down the layer stack only (DESIGN.md); kernels import nothing from toolkit."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "toolkit"
# Higher number = higher layer. eval and train are siblings that must not import each other.
LAYER = {"core": 0, "kernels": 1, "models": 2, "data": 3, "train": 4, "eval": 4, "pipeline": 5, "cli": 6,
         "__init__": 0, "__main__": 7}


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return [m for m in found if m == "toolkit" or m.startswith("toolkit.")]


def test_imports_point_down_only():
    violations = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        src = layer_of(".".join(rel.parts))
        for target in imports(path):
            dst = layer_of(target)
            if dst == "__init__" and target == "toolkit":
                continue
            same_level_sibling = LAYER[src] == LAYER[dst] and src != dst
            if LAYER[dst] > LAYER[src] or same_level_sibling or (src == "kernels" and dst != "kernels"):
                violations.append(f"{rel}: imports {target}")
    assert violations == []
