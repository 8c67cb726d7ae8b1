"""YAML from files cliptk did not write: safe tags only, and a bound on what aliases expand to.

``yaml.safe_load`` builds no arbitrary objects, but it does follow aliases: nine levels of nine aliases
each (the "billion laughs" document, 900 bytes) describe 9**9 = 387 million strings. PyYAML itself
shares the repeated objects, so loading is quick; whatever walks the value afterwards (merging,
``${...}`` substitution, an error message's repr) expands it, and `data shard --config` ran past 30 s
at 1.6 GB while seven levels made a 34 MB error message (issue 15 item 1). So the composed node graph
is measured first, counting a node once per path that reaches it, and a document that would expand
beyond :data:`MAX_EXPANDED_NODES` nodes or :data:`MAX_EXPANDED_CHARS` scalar characters is refused
before anything is constructed. The measurement is linear in the number of distinct nodes.

PyYAML keeps the last of two equal keys in one mapping (``steps: 2`` ... ``steps: 5`` gives 5), so a
key given twice by mistake changes a run without a word; :func:`check_duplicate_keys` refuses it, naming
both lines and the key path (merge keys ``<<: *base`` may still be overridden: they are not duplicates).
"""

from __future__ import annotations

from typing import IO, Any

import yaml

# The largest configs in the repository (the preset pipelines) hold a few hundred nodes and a few kB of
# text; 100k nodes and 10 MB leave room for long class lists while a bomb of 7 levels (4.8M nodes) is out.
MAX_EXPANDED_NODES = 100_000
MAX_EXPANDED_CHARS = 10_000_000


class YamlTooLarge(yaml.YAMLError):
    """The document's aliases expand beyond the limits, refer to themselves or nest too deeply."""


class DuplicateKey(yaml.YAMLError):
    """A mapping gives the same key twice; ``key`` is its dotted path, ``line`` the second one (1-based)."""

    def __init__(self, key: str, line: int, first_line: int):
        self.key, self.line, self.first_line = key, line, first_line
        super().__init__(
            f"duplicate key {key!r} at line {line} (first given at line {first_line}); "
            "YAML would keep only the last value: remove one"
        )


def check_duplicate_keys(root: yaml.Node) -> None:
    """Raise :class:`DuplicateKey` for the scalar key given twice in one mapping of ``root`` whose second
    occurrence comes first in the document. Each node is visited once (aliases share nodes); iterative."""
    found: list[DuplicateKey] = []
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                name = f"{path}.{key.value}" if path else str(key.value)
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    line = key.start_mark.line + 1
                    if (key.tag, key.value) in first:
                        found.append(DuplicateKey(name, line, first[(key.tag, key.value)]))
                    first[(key.tag, key.value)] = line
                stack.append((value, name))
    if found:
        raise min(found, key=lambda err: err.line)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def expanded_size(
    root: yaml.Node, max_nodes: int = MAX_EXPANDED_NODES, max_chars: int = MAX_EXPANDED_CHARS
) -> tuple[int, int]:
    """(nodes, scalar characters) of ``root`` with every alias expanded; raise :class:`YamlTooLarge`
    as soon as either passes its limit, or on an alias inside its own anchor. Iterative: no recursion."""
    sizes: dict[int, tuple[int, int]] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            open_nodes.discard(key)
            nodes, chars = 1, len(node.value) if isinstance(node, yaml.ScalarNode) else 0
            for child in _children(node):
                child_nodes, child_chars = sizes[id(child)]
                nodes, chars = nodes + child_nodes, chars + child_chars
            if nodes > max_nodes or chars > max_chars:
                raise YamlTooLarge(
                    f"aliases expand to more than {max_nodes:,} nodes or {max_chars:,} characters "
                    f"(near line {node.start_mark.line + 1}); refusing to load it"
                )
            sizes[key] = (nodes, chars)
            continue
        if key in sizes:
            continue
        if key in open_nodes:  # reached again while its own children are being measured
            raise YamlTooLarge(
                f"an alias refers to the node that contains it (near line {node.start_mark.line + 1})"
            )
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node))
    return sizes[id(root)]


def load(stream: str | IO[str]) -> Any:
    """Like ``yaml.safe_load`` (None for an empty document), refusing alias bombs, recursive aliases and
    duplicate keys.

    Raises :class:`YamlTooLarge`, :class:`DuplicateKey` (``yaml.YAMLError``s) or PyYAML's own errors;
    messages quote no values."""
    loader = yaml.SafeLoader(stream)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError as err:
            raise YamlTooLarge("the document nests too deeply") from err
        if node is None:
            return None
        expanded_size(node)
        check_duplicate_keys(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()
