"""docs/architecture.md places every module of toolkit/: a module added without a line fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows() -> list[tuple[str, str]]:
    """(package, modules cell) of each row of the doc's file table."""
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = doc[doc.index("## Where each file lives") : doc.index("## The loss interface")]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0] not in ("package", "---"):
            rows.append((cells[0], cells[1]))
    return rows


TOKEN = re.compile(r"`([^`]*)`|([()])")


def _paths(package: str, cell: str) -> set[str]:
    """The whole paths (under toolkit/) a modules cell names: `name.py` in the row's package; `sub/name.py`,
    after which bare `other.py` names lie in sub/ too; `sub/` (`a.py`, `b.py`) for a sub-folder's files,
    and `sub/` itself. Other backticked words (`--loss`, class names) name no file."""
    paths: set[str] = set()
    folder, in_parens = "", False
    for match in TOKEN.finditer(cell):
        word, paren = match.groups()
        if paren:
            in_parens = paren == "("
            if not in_parens:
                folder = ""
            continue
        if word.endswith("/") and not in_parens:
            folder = word
            paths.add(f"{package}/{word.rstrip('/')}")
        elif word.endswith(".py"):
            if "/" in word:
                folder = word.rpartition("/")[0] + "/"
                paths.add(f"{package}/{word}")
            else:
                paths.add(f"{package}/{folder}{word}")
    return paths


def _documented(rows: list[tuple[str, str]]) -> set[str]:
    return set().union(*(_paths(package, cell) for package, cell in rows))


def _placed(parent: str, name: str, rows: list[tuple[str, str]]) -> bool:
    """The doc places module parent/name (relative to toolkit/) by its whole path."""
    return f"{parent}/{name}" in _documented(rows)


def test_every_module_is_placed_in_the_architecture_doc():
    rows = _rows()
    missing = []
    for path in sorted((ROOT / "toolkit").rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        rel = path.relative_to(ROOT / "toolkit")
        if not _placed(str(rel.parent), path.name, rows):
            missing.append(str(rel))
    assert not missing, f"docs/architecture.md does not place: {', '.join(missing)}"


def test_the_check_itself_catches_a_module_missing_from_the_table():
    rows = _rows()
    assert _placed("train/losses/fastclip", "tables.py", rows)
    assert not _placed("train/losses/fastclip", "nonexistent.py", rows)
    assert not _placed("train", "tables.py", rows)  # a name is placed only under its own package
    assert not _placed("kernels/siglip", "ed.py", rows)  # whole names: not a substring of `tiled.py`
    assert _paths("data", "`acquire/urllist.py`, `urlrows.py`") == {
        "data/acquire/urllist.py",
        "data/acquire/urlrows.py",
    }


def test_every_file_the_doc_names_exists():
    missing = sorted(p for p in _documented(_rows()) if not (ROOT / "toolkit" / p).exists())
    assert not missing, f"docs/architecture.md names files that do not exist: {', '.join(missing)}"
