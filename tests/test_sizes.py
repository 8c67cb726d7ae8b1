"""House limits that keep toolkit/ readable: no function over 80 lines, no class over 180.

A dataclass's field declarations do not count towards its class's lines: since the tree is formatted
(ruff format, line length 110) each documented config option spans 3-5 lines, so TrainConfig's 52 fields
take 195 lines on their own; a list of documented fields reads as a table, while its methods and everything
else in a class still count."""

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
                lines = node.end_lineno - node.lineno + 1 - _field_lines(node)
                if lines > limit:
                    over.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} > {limit})")
    assert not over, "split these: " + "; ".join(over)


def _field_lines(node: ast.AST) -> int:
    """Lines taken by the annotated field declarations of a ``@dataclass`` class (0 for anything else)."""
    if not isinstance(node, ast.ClassDef) or not any(_is_dataclass(d) for d in node.decorator_list):
        return 0
    return sum(b.end_lineno - b.lineno + 1 for b in node.body if isinstance(b, ast.AnnAssign))


def _is_dataclass(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return (isinstance(target, ast.Name) and target.id == "dataclass") or (
        isinstance(target, ast.Attribute) and target.attr == "dataclass"
    )
