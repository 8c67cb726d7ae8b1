"""Storage modes: how a training set holds its images (``dataset.json``'s ``storage``; docs/data-format.md).

Each mode is one :class:`~toolkit.data.trainset.storage.base.StorageMode` object in a module of its own
(``pixels``, ``jpeg``, ``index``) and owns everything that differs between modes: what precompute writes per
sample (its scratch rows and files, its training files and their suffixes), what the loader reads and checks,
what ``toolkit data verify`` checks and ``toolkit data inspect`` shows, and its bytes per sample for
``toolkit plan``. This registry is the one list of them; a mode from another package joins it with
:func:`register` and is then accepted by ``--storage``, written into ``dataset.json`` and read back by name.
"""

from __future__ import annotations

import os
import re
from typing import Any

from toolkit.core import files
from toolkit.data.raw.layout import SHARD_DIGITS

_MODES: dict[str, Any] = {}  # name -> StorageMode (storage/base.py)


def _builtins() -> None:
    if not _MODES:  # the built-in modes, in this order, imported on first use (not by `toolkit --help`)
        from toolkit.data.trainset.storage.index import IndexMode
        from toolkit.data.trainset.storage.jpeg import JpegMode
        from toolkit.data.trainset.storage.pixels import PixelsMode

        for mode in (PixelsMode(), JpegMode(), IndexMode()):
            _MODES.setdefault(mode.name, mode)


def register(mode: Any) -> Any:
    """Add ``mode`` under ``mode.name`` (ValueError if another object has that name); returns it."""
    _builtins()
    if _MODES.get(mode.name, mode) is not mode:
        taken = type(_MODES[mode.name]).__name__
        raise ValueError(f"storage mode {mode.name!r} is registered already ({taken})")
    _MODES[mode.name] = mode
    return mode


def names() -> tuple[str, ...]:
    """Every registered mode's name, the built-in ones first."""
    _builtins()
    return tuple(_MODES)


def get(name: str) -> Any:
    """The mode called ``name``; ValueError naming the registered ones otherwise."""
    _builtins()
    if name not in _MODES:
        raise ValueError(
            f"storage {name!r}: not a storage mode of this toolkit (known: {', '.join(_MODES)}; "
            "a mode of another package is known once that package registers it)"
        )
    return _MODES[name]


def of(ds: Any) -> Any:
    """The mode of dataset ``ds`` (a TrainDataset); ValueError naming its dataset.json when no registered
    mode has its name. Readers call it before their first read."""
    try:
        return get(ds.storage)
    except ValueError as err:
        raise ValueError(f"{files.join(ds.root, 'dataset.json')}: {err}") from None


def part_suffixes() -> tuple[str, ...]:
    """Every suffix of a per-part file (``NNNNN<suffix>``) a registered mode writes, and ``.meta.jsonl``."""
    _builtins()
    return (*sorted({s for m in _MODES.values() for s in m.suffixes}), ".meta.jsonl")


def part_file_pattern() -> re.Pattern[str]:
    """The names precompute writes, replaces and deletes in its output (``NNNNN`` + :func:`part_suffixes`):
    in an --out without a precompute manifest such files are someone else's, so precompute refuses it."""
    ends = "|".join(re.escape(s) for s in part_suffixes())
    return re.compile(rf"\d{{{SHARD_DIGITS}}}({ends})")


def remove_stale_parts(out: str, keep: int, mode: Any) -> int:
    """Delete the per-part files (``NNNNN`` + a suffix of any registered mode, or ``.meta.jsonl``) with index
    >= keep left by an earlier, larger run, and every such file of another mode's earlier run: those whose
    suffix ``mode`` (the mode written now) does not write. Called by precompute's writing process."""
    used = (*mode.suffixes, ".meta.jsonl")
    every = part_suffixes()
    if not files.is_local(out) or not os.path.isdir(files.local_path(out)):
        return 0
    removed = 0
    for name in os.listdir(files.local_path(out)):
        stem = name.split(".", 1)[0]
        if (
            stem.isdigit()
            and len(stem) == SHARD_DIGITS
            and name.endswith(every)
            and (int(stem) >= keep or not name.endswith(used))
        ):
            os.remove(os.path.join(files.local_path(out), name))
            removed += 1
    return removed
