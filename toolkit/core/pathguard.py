"""Refuse a stage output that is one of its inputs, holds one, or lies inside one.

Comparing the strings the user typed is not enough: ``r``, ``./r/``, ``$PWD/r``, ``file:///…/r``, a
symlink to ``r`` and a bind mount of ``r`` all name the same folder, and a stage that writes there
destroys what it reads (precompute replaced its raw shards; train replaced the precompute's manifest).
Local paths are compared twice: as resolved paths (symlinks followed, ``..`` folded) and by filesystem
identity (device and inode of the path and each of its existing ancestors, which also catches bind mounts);
a file directly in the output folder that is an input file under another name (a hard link) counts too.
fsspec URLs are compared by protocol and normalised path. Called by :func:`toolkit.core.stage.stage_run`
on the process that owns the output, before anything is written.
"""

from __future__ import annotations

import os
import re

from toolkit.core import files
from toolkit.core.config import ConfigError

# Characters that start a glob or brace pattern: an input such as dir/{00000..00009}.tar names files in dir.
_PATTERN = re.compile(r"[*?\[{]")


class OutputIsInput(ConfigError):
    """The output folder would overwrite (or be written inside) an input of the same stage (exit code 2)."""


def _pattern_base(path: str) -> str:
    """The folder part of ``path`` before its first glob/brace character (``path`` itself if none)."""
    match = _PATTERN.search(path)
    if match is None:
        return path
    return path[: match.start()].rsplit("/", 1)[0] or "/"


def _chain(path: str) -> list[tuple[int, int]]:
    """(device, inode) of ``path`` and of each existing ancestor, the path itself first (skipped if
    missing)."""
    ids, current = [], os.path.abspath(path)
    while True:
        try:
            st = os.stat(current)
            ids.append((st.st_dev, st.st_ino))
        except OSError:
            pass
        parent = os.path.dirname(current)
        if parent == current:
            return ids
        current = parent


def _id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _within(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def _file_ids(path: str) -> dict[tuple[int, int], str]:
    """(device, inode) -> name of ``path`` if a file, else of the files directly in folder ``path``."""
    if os.path.isfile(path):
        return {_id(path): os.path.basename(path)}
    try:
        with os.scandir(path) as entries:
            return {(e.stat().st_dev, e.stat().st_ino): e.name for e in entries if e.is_file()}
    except OSError:
        return {}


def _linked(out: str, inp: str) -> str | None:
    """The name of a file directly in folder ``out`` that is a file of ``inp`` under another name (a hard
    link): a stage replacing or deleting its own files by name there would touch the input's data."""
    if not os.path.isdir(out):
        return None
    ours = _file_ids(out)
    return next((ours[i] for i in _file_ids(inp) if i in ours), None) if ours else None


def _local_relation(out: str, inp: str) -> str | None:
    """'is', 'holds' or 'lies inside' when local ``out`` and ``inp`` overlap, else None."""
    out_real, in_real = os.path.realpath(out), os.path.realpath(inp)
    out_id, in_id = _id(out_real), _id(in_real)
    if out_real == in_real or (out_id is not None and out_id == in_id):
        return "is"
    if _within(in_real, out_real) or (out_id is not None and out_id in _chain(in_real)[1:]):
        return "holds"
    if _within(out_real, in_real) or (in_id is not None and in_id in _chain(out_real)[1:]):
        return "lies inside"
    link = _linked(out_real, in_real)
    return f"holds {link}, the same file (a hard link) as a file of" if link else None


def _remote_key(url: str) -> tuple[str, str]:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol, "/" + path.strip("/")


def relation(out: str, inp: str) -> str | None:
    """How output ``out`` overlaps input ``inp`` ('is', 'holds', 'lies inside'), or None when apart."""
    inp = _pattern_base(inp)
    if files.is_local(out) and files.is_local(inp):
        return _local_relation(files.local_path(out), files.local_path(inp))
    if files.is_local(out) != files.is_local(inp):
        return None
    try:
        (out_proto, out_path), (in_proto, in_path) = _remote_key(out), _remote_key(inp)
    except (ImportError, ValueError):  # an unknown backend: the stage's own open names it
        return None
    if out_proto != in_proto:
        return None
    if out_path == in_path:
        return "is"
    if _within(in_path, out_path):
        return "holds"
    return "lies inside" if _within(out_path, in_path) else None


def check_url_schemes(kind: str, paths: dict[str, str]) -> None:
    """ConfigError naming the key and URL of a path whose scheme fsspec does not know, or whose backend
    package is not installed (naming the package), before any stage opens it.

    ``paths``: config key -> local path or fsspec URL (a stage's inputs and its ``out``)."""
    import fsspec

    for key, path in paths.items():
        if files.is_local(path) or not isinstance(path, str):
            continue
        protocol = path.split("://", 1)[0]
        if protocol.lower() in ("http", "https"):  # URL lists and demo sites: fetched by cliptk's own client
            continue
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as err:
            raise ConfigError(
                kind,
                key,
                f"{path}: the {protocol}:// file system needs a package that is not "
                f"installed ({err}); pip install it",
            ) from None
        except ValueError:
            known = ", ".join(sorted(p for p in fsspec.available_protocols() if len(p) > 1)[:12])
            raise ConfigError(
                kind, key, f"{path}: unknown URL scheme {protocol!r} (known: {known}, ...)"
            ) from None


def check_output_apart(kind: str, out: str, inputs: dict[str, str]) -> None:
    """Raise :class:`OutputIsInput` (one line naming the key and both paths) if ``out`` overlaps an input.

    ``inputs`` maps config keys to paths (:func:`toolkit.core.config.input_paths`).
    """
    for key, inp in inputs.items():
        how = relation(out, inp)
        if how is not None:
            raise OutputIsInput(
                kind,
                "out",
                f"must differ from input {key} ({inp}): {out} {how} it, and writing "
                "there would overwrite what the stage reads; choose a folder outside the inputs",
            )
