"""Import rules of the ``toolkit`` package, checked on its source with ``ast``.

- Imports point down the layer stack only: cli > pipeline > trainval > eval | train > data > models >
  kernels | core; siblings (eval and train, kernels and core) never import each other, and kernels import
  nothing from toolkit.
- No import cycles between toolkit modules.
- Inside a package, no arrow runs back between its parts: with each direct sub-package or module taken as
  one node, the package's import graph has no cycle (``train/runtime.py`` -> ``train/plan/`` while
  ``plan`` imports ``runtime`` fails, though no two modules form a cycle).
- No source folder is named like a build output (dist, build, out): .gitignore and ruff's default
  excludes hide such folders, so code in them would go unlinted or uncommitted.

Every import counts: module level, inside functions (lazy imports) and under ``if TYPE_CHECKING``;
``from toolkit.x import y`` is an import of the submodule ``toolkit.x.y`` when that module exists, and
relative imports are resolved against the importing module's package. Importing ``a.b.c`` is an edge to
``a.b.c`` only: Python runs the parent packages' ``__init__`` first, but a package that re-exports its own
modules is not a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "toolkit"
# Higher number = higher layer. Modules of the same number but different layers are siblings.
LAYER = {
    "core": 0,
    "kernels": 0,
    "models": 2,
    "data": 3,
    "train": 4,
    "eval": 4,
    "trainval": 5,
    "pipeline": 6,
    "cli": 7,
    "__init__": 0,
    "__main__": 8,
}
BUILD_OUTPUT_NAMES = {"dist", "build", "out"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def imported_modules(module: str, path: Path, known: set[str]) -> set[str]:
    """The toolkit modules ``module`` imports anywhere in its source (see the module docstring)."""

    def resolve(name: str) -> str | None:  # the module itself, or the package that defines the name
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(resolve(a.name) for a in node.names if a.name.split(".")[0] == "toolkit")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = _package_of(module, path).split(".")
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            if base.split(".")[0] != "toolkit":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else resolve(base))
    return {m for m in found if m is not None}


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {m: imported_modules(m, p, set(modules)) for m, p in modules.items()}


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules of every import cycle: strongly connected components of more than one module (or of a
    module importing itself), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the graph has a few hundred nodes, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(components)


def example_cycle(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest import path from the component's first module back to itself, inside the component."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # unreachable for a strongly connected component


def test_imports_point_down_only():
    violations = []
    for src_module, targets in import_graph().items():
        src = layer_of(src_module)
        for target in sorted(targets):
            if target == "toolkit":  # the root package holds only __version__
                continue
            dst = layer_of(target)
            same_level_sibling = LAYER[src] == LAYER[dst] and src != dst
            if LAYER[dst] > LAYER[src] or same_level_sibling or (src == "kernels" and dst != "kernels"):
                violations.append(f"{src_module}: imports {target}")
    assert violations == []


def test_no_import_cycles():
    graph = import_graph()
    found = [f"{', '.join(c)} (e.g. {' -> '.join(example_cycle(c, graph))})" for c in cycles(graph)]
    assert found == [], "import cycles between these modules:\n" + "\n".join(found)


# losses/ is the one package whose parts are plug-ins: LossConfig (losses/config.py) holds each objective
# folder's section (fastclip/config.py, ...) and each folder's loss reads LossConfig and the shared base and
# modes; the folders and the shared modules form one unit, whose modules are still checked for cycles one by
# one.
PLUGIN_PACKAGES = {"toolkit.train.losses"}


def part_cycles(graph: dict[str, set[str]]) -> list[tuple[str, tuple[str, ...]]]:
    """(package, its parts in a cycle) for every package whose direct sub-packages and modules, each taken as
    one node, import each other in a cycle."""
    packages = {m.rpartition(".")[0] for m in graph if "." in m} | {m for m in graph if m != "toolkit"}
    found = []
    for package in sorted(packages):

        def part(module: str, package: str = package) -> str | None:
            rest = module[len(package) + 1 :] if module.startswith(package + ".") else ""
            return f"{package}.{rest.split('.')[0]}" if rest else None

        parts: dict[str, set[str]] = {}
        for src, targets in graph.items():
            if part(src) is not None:
                parts.setdefault(part(src), set()).update(
                    t for t in map(part, targets) if t not in (None, part(src))
                )
        found += [(package, tuple(c)) for c in cycles(parts)]
    return found


def test_no_arrow_runs_back_between_the_parts_of_a_package():
    graph = import_graph()
    found = [
        f"{package}: {', '.join(parts)}"
        for package, parts in part_cycles(graph)
        if package not in PLUGIN_PACKAGES
    ]
    assert found == [], (
        "parts of a package that import each other (make one of them the lower one):\n" + "\n".join(found)
    )


def test_part_cycles_find_an_arrow_back_between_sub_packages():
    graph = {
        "toolkit.t.runtime": {"toolkit.t.plan.hostmem"},
        "toolkit.t.plan.hostmem": set(),
        "toolkit.t.plan.memprobe": {"toolkit.t.runtime"},
        "toolkit.t.loop": {"toolkit.t.runtime"},
    }
    assert part_cycles(graph) == [("toolkit.t", ("toolkit.t.plan", "toolkit.t.runtime"))]
    del graph["toolkit.t.runtime"]
    assert part_cycles({**graph, "toolkit.t.runtime": set()}) == []


def test_cycle_finder_reports_the_modules_of_a_cycle():
    graph = {"a": {"b"}, "b": {"c", "a"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"a"}}
    assert cycles(graph) == [["a", "b", "c"], ["e"]]
    assert example_cycle(["a", "b", "c"], graph) == ["a", "b", "a"] and example_cycle(["e"], graph) == [
        "e",
        "e",
    ]


def test_from_import_of_a_submodule_and_relative_imports_are_edges(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "def f():\n    from toolkit.data import images\n    from . import fetch\n"
        "    from ..raw.layout import shard_stem\n"
    )
    known = {
        "toolkit.data",
        "toolkit.data.images",
        "toolkit.data.acquire",
        "toolkit.data.acquire.fetch",
        "toolkit.data.raw.layout",
        "toolkit.data.acquire.m",
    }
    assert imported_modules("toolkit.data.acquire.m", path, known) == {
        "toolkit.data.images",
        "toolkit.data.acquire.fetch",
        "toolkit.data.raw.layout",
    }


def test_no_folder_named_like_a_build_output():
    bad = [
        str(p.relative_to(REPO))
        for top in (ROOT, REPO / "tests")
        for p in top.rglob("*")
        if p.is_dir() and p.name in BUILD_OUTPUT_NAMES
    ]
    assert bad == [], f"rename these folders (.gitignore / ruff's default excludes hide them): {bad}"
