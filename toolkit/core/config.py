"""Frozen typed dataclass configs shared by the CLI and pipeline YAML.

:func:`build` validates a mapping against a config class; every error is a :class:`ConfigError` that names
the source (file or ``--set``) and the key path. Loading from the sources in their precedence (dataclass
defaults < YAML mapping < ``--set a.b=value`` overrides < explicit CLI options) is
:func:`toolkit.core.config_load.load_config`.

Declare fields with :func:`option` so each has a one-line doc (shown by ``--help`` and ``toolkit
pipeline kinds``), optional bounds, and flags for whether it affects outputs (excluded from the hash
if not: a rerun with more worker processes still skips) and whether it names an input path (its
fingerprint is recorded in the stage manifest).
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import operator
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from toolkit.core.config_error import ConfigError

T = TypeVar("T")
MISSING = dataclasses.MISSING


def option(
    default: Any = MISSING,
    *,
    doc: str,
    factory: Any = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    affects_output: bool = True,
    is_input: bool = False,
    omit_at_default: bool = False,
    absent_means: Any = MISSING,
) -> Any:
    """A dataclass field with a doc string, bounds and manifest roles (see module docstring).
    ``omit_at_default``: a field added after configs were recorded (checkpoints, results) stays out of
    :func:`to_dict` and the hash while at its default, so those records still load equal and match.
    ``absent_means``: a field added after configs were recorded, which stays in the hash: a record that
    lacks it was written with this value (the behaviour before the field existed), so
    ``config_changes.changed_keys`` with ``absent_values`` reports no change where the run uses that value."""
    metadata = {
        "doc": doc,
        "ge": ge,
        "gt": gt,
        "le": le,
        "affects_output": affects_output,
        "is_input": is_input,
        "omit_at_default": omit_at_default,
        "absent_means": absent_means,
    }
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


# ---------------------------------------------------------------- building and validation


# Longest quoted value in an error message: a value from a file is quoted, never printed whole.
SHORT_REPR_CHARS = 80


def short(value: Any, limit: int = SHORT_REPR_CHARS) -> str:
    """``repr(value)``, cut to ``limit`` characters with the full length named."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, source: str, key: str) -> Any:
    """Check ``value`` against annotation ``tp``; return it converted where that is lossless."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(arg, value, source, key)
            except ConfigError as err:
                errors.append(err.message)
        raise ConfigError(source, key, f"expected {_type_name(tp)}, got {short(value)}")
    if origin is Literal:
        if value in args:
            return value
        hint = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
        extra = f"; did you mean {hint[0]!r}?" if hint else ""
        raise ConfigError(
            source, key, f"must be one of {', '.join(repr(a) for a in args)}, got {short(value)}{extra}"
        )
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(source, key, f"expected a mapping for {tp.__name__}, got {short(value)}")
        return build(tp, value, source=source, prefix=key)
    if origin in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(source, key, f"expected a list, got {short(value)}")
        item_tp = args[0] if args else Any
        items = [_coerce(item_tp, v, source, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(source, key, f"expected a mapping, got {short(value)}")
        val_tp = args[1] if len(args) == 2 else Any
        return {str(k): _coerce(val_tp, v, source, f"{key}.{k}") for k, v in value.items()}
    return _coerce_scalar(tp, value, source, key)


def _coerce_scalar(tp: Any, value: Any, source: str, key: str) -> Any:
    """bool, int, float (also from strings such as '1e-3'), str, Path or any other class."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(source, key, f"expected true or false, got {short(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(source, key, f"expected an integer, got {short(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads '1e-3' (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(source, key, f"expected a number, got {short(value)}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(source, key, f"expected a string, got {short(value)}")
    if tp is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise ConfigError(source, key, f"expected a path, got {short(value)}")
    if isinstance(value, tp):
        return value
    raise ConfigError(source, key, f"expected {_type_name(tp)}, got {short(value)}")


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_BOUNDS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<=")}


def _check_range(f: dataclasses.Field, value: Any, source: str, key: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    # what every consumer can hold: torch/numpy seeds and counts are int64 ("Overflow when unpacking long
    # long"), and an infinite or NaN float breaks the formulas it enters ("math domain error")
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:
        raise ConfigError(
            source, key, f"must fit in 64 bits ({INT64_MIN} to {INT64_MAX}), got {short(value)}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(
            source,
            key,
            f"must be a finite number, got {value} (a value past the float range reads as infinity)",
        )
    for name, (op, word) in _BOUNDS.items():
        bound = f.metadata.get(name)
        if bound is not None and not op(value, bound):
            raise ConfigError(source, key, f"must be {word} {bound}, got {short(value)}")


def suggest(name: str, known: list[str]) -> str:
    hint = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean {hint[0]!r}?" if hint else f"; known keys: {', '.join(known)}"


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` on top, mappings merged key by key (neither input is changed)."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def build(cls: type[T], data: Mapping[str, Any] | None, *, source: str = "<config>", prefix: str = "") -> T:
    """Validate ``data`` against dataclass ``cls`` and return the frozen instance.

    A config class may define ``layered_defaults(data, source) -> mapping``: defaults that depend on the
    data itself (the trainer's ``preset``), merged beneath ``data`` before validation, so every way of
    building the config (CLI, YAML, ``--set``, pipelines) applies them the same way."""
    data = dict(data or {})
    layered = getattr(cls, "layered_defaults", None)
    if layered is not None:
        data = deep_merge(layered(data, source), data)
    return _build(cls, data, source, prefix)


def _build(cls: type[T], data: dict[str, Any], source: str, prefix: str) -> T:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for name in data:
        if name not in fields:
            name = str(name) if len(str(name)) <= SHORT_REPR_CHARS else short(name)
            key = f"{prefix}.{name}" if prefix else name
            moved = getattr(cls, "moved_keys", {}).get(name)
            if moved is not None:  # a key that became a section's: named with its new place, never read
                where = f"{prefix}.{moved}" if prefix else moved
                raise ConfigError(
                    source,
                    key,
                    f"unknown key: it is {where} now (configs and records written "
                    f"before 2026-11-26 kept it flat); write it as {where}",
                )
            raise ConfigError(source, key, "unknown key" + suggest(name, list(fields)))
    kwargs = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if name in data:
            kwargs[name] = _coerce(hints[name], data[name], source, key)
            _check_range(f, kwargs[name], source, key)
            _check_not_empty(f, data[name], source, key)  # the raw value: Path("") reads as "."
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(source, key, f"missing required value ({f.metadata.get('doc', '')})")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:  # __post_init__ cross-field checks
        if isinstance(err, ConfigError):
            raise
        name, sep, message = str(err).partition(": ")  # 'field: message' ('section.field: ...') blames it
        if sep and name.split(".")[0] in fields:
            raise ConfigError(source, f"{prefix}.{name}" if prefix else name, message) from err
        raise ConfigError(source, prefix, str(err)) from err


def _check_not_empty(f: dataclasses.Field, value: Any, source: str, key: str) -> None:
    """A required text field (a path, a URL list, a model name) given as '' or blanks is refused by name:
    an empty `--data ''` used to become the path '/dataset.json' and `--out ''` "No such file: ''"."""
    required = f.default is MISSING and f.default_factory is MISSING
    if required and isinstance(value, (str, Path)) and not str(value).strip():
        raise ConfigError(source, key, f"is empty; give a value ({f.metadata.get('doc', '')})")


# ---------------------------------------------------------------- serialisation and hashing


def _kept(cfg: Any, f: dataclasses.Field) -> bool:
    """False for an ``omit_at_default`` field at its default (see :func:`option`)."""
    if not f.metadata.get("omit_at_default"):
        return True
    return getattr(cfg, f.name) != (f.default if f.default is not MISSING else f.default_factory())


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if _kept(obj, f)}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


def to_dict(cfg: Any) -> dict:
    """Plain-data form of a config (Paths as strings, tuples as lists)."""
    return json.loads(json.dumps(_plain(cfg), default=str))


def _hashed(cfg: Any) -> Any:
    if not dataclasses.is_dataclass(cfg):
        return cfg
    return {
        f.name: _hashed(getattr(cfg, f.name))
        for f in dataclasses.fields(cfg)
        if f.metadata.get("affects_output", True) and _kept(cfg, f)
    }


def config_hash(cfg: Any, *extra: Any) -> str:
    """Stable 16-hex-digit hash of the fields that affect outputs (plus ``extra`` values)."""
    payload = json.dumps([_hashed(cfg), *extra], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def output_dict(cfg: Any) -> dict:
    """The fields :func:`config_hash` hashes (``affects_output``), as plain JSON data: what a result records
    so that a later refusal can name the keys that differ (``config_changes.changed_keys``)."""
    return json.loads(json.dumps(_hashed(cfg), default=str))


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def input_paths(cfg: Any, prefix: str = "") -> dict[str, str]:
    """Key path -> value of every non-empty field declared ``is_input=True`` (nested configs too)."""
    found: dict[str, str] = {}
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            found.update(input_paths(value, key + "."))
        elif f.metadata.get("is_input") and value:
            if isinstance(value, (list, tuple)):
                found.update({f"{key}[{i}]": str(v) for i, v in enumerate(value)})
            else:
                found[key] = str(value)
    return found
