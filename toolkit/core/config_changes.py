"""What differs between a recorded config and a run's: the keys a refusal names (a resume onto another
configuration, ``train/checkpoint/resume.py``), reading a key an older record lacks as the value its
absence meant (``option(absent_means=...)``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from toolkit.core.config import MISSING, short


def _leaves(data: Mapping, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def absent_values(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """Record key -> ``absent_means`` of every field of ``cfg`` (nested configs too) that declares one: what
    an older record that lacks the key was written with (:func:`option`). Keys as records write them: dotted
    for a section."""
    found: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            found.update(absent_values(value, key + "."))
        elif f.metadata.get("absent_means", MISSING) is not MISSING:
            found[key] = json.loads(json.dumps(f.metadata["absent_means"], default=str))
    return found


def changed_keys(
    old: Mapping, new: Mapping, absent: Mapping[str, Any] | None = None
) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) of every leaf that differs, in ``new``'s key order (keys only
    ``old`` has last); a key one side lacks has :data:`MISSING` there, except a key of ``absent``
    (:func:`absent_values`) that ``old`` lacks and ``new`` holds: it reads as the value it meant (a key
    neither record holds, e.g. an ``omit_at_default`` section at its default, is no difference)."""
    a, b = _leaves(old), _leaves(new)
    a.update({k: v for k, v in (absent or {}).items() if k not in a and k in b})
    return [
        (k, a.get(k, MISSING), b.get(k, MISSING))
        for k in {**b, **a}
        if a.get(k, MISSING) != b.get(k, MISSING)
    ]


def describe_changes(changes: list[tuple[str, Any, Any]], limit: int = 5, width: int = 32) -> str:
    """``'steps 2 -> 3, optim.lr 0.001 -> 0.002'``: the first ``limit`` changes on one line, each value cut
    to ``width`` characters, and how many more there are."""

    def show(value: Any) -> str:
        return "(unset)" if value is MISSING else short(value, width)

    text = ", ".join(f"{key} {show(old)} -> {show(new)}" for key, old, new in changes[:limit])
    return text + (f" and {len(changes) - limit} more" if len(changes) > limit else "")
