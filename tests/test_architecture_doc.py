"""docs/architecture.md places every module of toolkit/: a module added without a line fails here."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _rows() -> list[tuple[str, str]]:
    """(package, modules cell) of each row of the doc's file table."""
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = doc[doc.index("## Where each file lives"):doc.index("## The loss interface")]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0] not in ("package", "---"):
            rows.append((cells[0], cells[1]))
    return rows


def _placed(parent: str, name: str, rows: list[tuple[str, str]]) -> bool:
    """A row of package P places module parent/name when parent is P (the cell names `name`) or lies under
    it (the cell names the sub-folder, `sub/`, and the file)."""
    for package, cell in rows:
        if parent == package and f"`{name}`" in cell:
            return True
        if parent.startswith(package + "/"):
            sub = parent[len(package) + 1:]
            if f"{sub}/" in cell and name in cell:
                return True
    return False


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
