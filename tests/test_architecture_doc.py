"""docs/architecture.md places every module of toolkit/: a module added without a line fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_is_placed_in_the_architecture_doc():
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = doc[doc.index("## Where each file lives"):doc.index("## The loss interface")]
    named = set(re.findall(r"`([\w/]+\.py)`", table)) | {m + "/" for m in re.findall(r"`([\w]+)/`", table)}
    missing = []
    for path in sorted((ROOT / "toolkit").rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        rel = path.relative_to(ROOT / "toolkit")
        if path.name not in named and str(rel.relative_to(rel.parts[0])) not in named \
                and not any(str(rel.parent).endswith(d.rstrip("/")) for d in named if d.endswith("/")):
            missing.append(str(rel))
    assert not missing, f"docs/architecture.md does not place: {', '.join(missing)}"
