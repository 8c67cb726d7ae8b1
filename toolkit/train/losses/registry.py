"""The objectives ``build_loss`` knows, by ``kind``, and the ``--loss`` names that select them (torch-free,
so the CLI validates ``--loss`` without importing torch).

Each objective is a folder of ``losses/`` holding its ``TrainingLoss`` and a ``spec.py`` whose ``SPEC``
(an ``ObjectiveSpec``) says everything else about it: its ``--loss`` names and variants, the distributed
modes it runs in, its per-sample tables and traffic for ``toolkit plan``, how it starts the model's
logit scale and bias. ``OBJECTIVES`` lists the folders; an objective outside them plugs in with one
``register`` call. Every lookup reads the registry when it is made, so a later ``register`` counts
everywhere (``toolkit plan``, ``--loss``, config checks). docs/architecture.md has a worked example.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from toolkit.train.losses.spec import ObjectiveSpec

# the objectives' folders, in the order --loss lists their names; each has spec.py with SPEC
OBJECTIVES = (
    "toolkit.train.losses.openclip",
    "toolkit.train.losses.fastclip",
    "toolkit.train.losses.siglip",
    "toolkit.train.losses.neuclip",
    "toolkit.train.losses.drrho",
    "toolkit.train.losses.distill",
)
_SPECS: dict[str, ObjectiveSpec] = {}
_loaded = False


def _load_folders() -> None:
    """Import the folders' specs once; built-ins come first, then what was registered before (a
    re-registered built-in keeps its place and the new spec)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    registered = dict(_SPECS)
    _SPECS.clear()
    for folder in OBJECTIVES:
        found = importlib.import_module(f"{folder}.spec").SPEC
        _SPECS[found.kind] = found
    _SPECS.update(registered)


def register(
    kind: str | ObjectiveSpec,
    target: str | None = None,
    names: Mapping[str, Mapping[str, Any]] | None = None,
    **facts: Callable | tuple | str,
) -> ObjectiveSpec:
    """Make an objective buildable: ``register(SPEC)``, or ``register(kind, "module:Class", names, **facts)``
    with ``ObjectiveSpec``'s fields (``names``: --loss NAME -> extra LossConfig fields; default: the
    single name ``kind``). Replaces an objective of the same kind."""
    if isinstance(kind, ObjectiveSpec):
        spec = kind
    else:
        if target is None or ":" not in target:
            raise ValueError(f"register({kind!r}): target must be 'module:Class', got {target!r}")
        spec = ObjectiveSpec(kind=kind, target=target, names=dict(names or {}), **facts)
    _SPECS[spec.kind] = spec
    return spec


def specs() -> dict[str, ObjectiveSpec]:
    """kind -> its spec, every objective registered now (the folders' first)."""
    _load_folders()
    return dict(_SPECS)


def spec(kind: str) -> ObjectiveSpec:
    """The spec of objective ``kind``; a ValueError naming the known kinds otherwise."""
    known = specs()
    if kind not in known:
        raise ValueError(f"unknown loss kind {kind!r}; choose one of {', '.join(known)}")
    return known[kind]


def loss_names() -> dict[str, dict[str, Any]]:
    """--loss NAME -> the LossConfig fields it sets (kind and its variant), of every registered objective."""
    return {name: fields for s in specs().values() for name, fields in s.loss_names().items()}


def spec_of_name(name: str) -> tuple[ObjectiveSpec, dict[str, Any]]:
    """(spec, LossConfig fields) of ``--loss NAME``; a ValueError naming the known names otherwise."""
    names = loss_names()
    if name not in names:
        raise ValueError(f"unknown loss {name!r}; choose one of {', '.join(names)}")
    return spec(names[name]["kind"]), names[name]
