"""Sections whose fields were once keys of the config holding them (``legacy_prefix``), and the one migration
of those flat keys.

A config that splits some of its fields into a section (``LossConfig``'s FastCLIP fields into ``loss.fastclip``)
declares the section with ``option(..., legacy_prefix="")`` (``"siglip_"``: ``siglip_scale_init`` was the flat
name of ``siglip.scale_init``). Then, in both directions:

- reading: :func:`migrate` moves each flat key ``PREFIX + name`` of a mapping into the section (YAML files,
  presets, ``build`` from a dict, checkpoints' recorded configs), and :func:`migrate_path` does it for one
  dotted key (``--set loss.version=v2``, a CLI option), so a later source still overrides an earlier one
  whichever layout each uses. A key given in both layouts in one mapping is an error naming both; a key
  that is neither a field nor a flat name stays unknown (``build`` names it).
- recording: ``to_dict`` and ``config_hash`` write the section's fields back as the flat keys (core.config),
  so every record made before the split (checkpoints' ``config`` and ``config_hash``, stage manifests,
  results) still compares equal and hashes the same.
Torch-free; imported by core.config (it imports only ``config_error``).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from typing import Any

from toolkit.core.config_error import ConfigError


def legacy_prefix(f: dataclasses.Field) -> str | None:
    """The flat-key prefix a section field was declared with, None for an ordinary field."""
    return f.metadata.get("legacy_prefix")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def flat_keys(cls: type) -> dict[str, tuple[str, str]]:
    """Flat key -> (section field, its key there), for every ``legacy_prefix`` section of dataclass ``cls``."""
    out: dict[str, tuple[str, str]] = {}
    for f in dataclasses.fields(cls):
        prefix = legacy_prefix(f)
        if prefix is not None:
            out.update({prefix + sub.name: (f.name, sub.name) for sub in dataclasses.fields(_hints(cls)[f.name])})
    return out


def _section_type(cls: Any, name: str) -> Any:
    """The dataclass type of field ``name`` of ``cls``, None if it is not a section."""
    if not dataclasses.is_dataclass(cls) or name not in {f.name for f in dataclasses.fields(cls)}:
        return None
    tp = _hints(cls).get(name)
    return tp if dataclasses.is_dataclass(tp) else None


def migrate(cls: type, data: Mapping[str, Any], source: str, prefix: str = "") -> tuple[dict, dict[str, str]]:
    """``data`` for dataclass ``cls`` with every flat key moved into its section, in nested sections too (the
    input is not changed). Returns (migrated data, {new dotted key: the key as given}) so errors can name the
    key the user wrote. A value given both flat and in its section is a ConfigError naming both."""
    out, renamed = dict(data), {}
    fields = {f.name for f in dataclasses.fields(cls)}
    for key, (section, sub) in flat_keys(cls).items():
        if key not in out or key in fields:
            continue
        target = out.get(section) if out.get(section) is not None else {}
        if not isinstance(target, Mapping):
            continue  # a malformed section: build() names it
        if sub in target:
            raise ConfigError(source, prefix + key, f"given twice: as {prefix}{key} (the flat name it had before "
                                                    f"{prefix}{section} became a section) and as "
                                                    f"{prefix}{section}.{sub}; keep one")
        out[section] = {**target, sub: out.pop(key)}
        renamed[f"{prefix}{section}.{sub}"] = prefix + key
    for name in fields:
        tp = _section_type(cls, name)
        if tp is not None and isinstance(out.get(name), Mapping):
            out[name], more = migrate(tp, out[name], source, f"{prefix}{name}.")
            renamed.update(more)
    return out, renamed


def migrate_path(cls: type, path: list[str]) -> list[str]:
    """A dotted key's parts with a flat key replaced by its section's (``['loss', 'version']`` ->
    ``['loss', 'fastclip', 'version']``); other paths come back unchanged."""
    out: list[str] = []
    tp: Any = cls
    for i, part in enumerate(path):
        if not dataclasses.is_dataclass(tp):
            return out + list(path[i:])
        if part not in {f.name for f in dataclasses.fields(tp)} and part in flat_keys(tp):
            section, part = flat_keys(tp)[part]
            out.append(section)
            tp = _section_type(tp, section)
        out.append(part)
        tp = _section_type(tp, part)
    return out


def record(fields: list[tuple[dataclasses.Field, Any]]) -> dict[str, Any]:
    """A config's record from (field, its recorded value) pairs: a ``legacy_prefix`` section's keys become
    the holding config's flat keys again; other fields keep their names."""
    out: dict[str, Any] = {}
    for f, value in fields:
        prefix = legacy_prefix(f)
        if prefix is None or not isinstance(value, Mapping):
            out[f.name] = value
        else:
            out.update({prefix + k: v for k, v in value.items()})
    return out
