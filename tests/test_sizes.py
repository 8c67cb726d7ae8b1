"""House limits that keep toolkit/ readable: no function over 80 lines, no class over 180."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 80, 180


def test_no_function_or_class_is_over_the_limits():
    over = []
    for path in sorted((ROOT / "toolkit").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    over.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} > {limit})")
    assert not over, "split these: " + "; ".join(over)
