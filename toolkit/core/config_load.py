"""Loading a config from its sources: dataclass defaults < YAML file < ``--set a.b=value`` overrides <
explicit CLI options (:func:`load_config`), each error a :class:`ConfigError` naming where the offending
value came from (the file, the ``--set`` text or the option) and the key path.

:func:`read_yaml`, :func:`parse_override` and :func:`set_path` are also the pipeline runner's; building and
validating the merged mapping is :func:`toolkit.core.config.build`.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml

from toolkit.core import safeyaml
from toolkit.core.config import build
from toolkit.core.config_error import ConfigError

T = TypeVar("T")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'a.b=3'`` -> (['a', 'b'], 3); the value is parsed as YAML (numbers, booleans, lists)."""
    if "=" not in text:
        raise ConfigError("--set", text, "expected KEY=VALUE (a dotted key for nested values)")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError("--set", text, "empty key")
    try:
        value = safeyaml.load(raw) if raw.strip() else ""
    except (safeyaml.YamlTooLarge, safeyaml.DuplicateKey) as err:
        raise ConfigError("--set", key.strip(), f"invalid YAML value: {err}") from None
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def set_path(data: dict, path: list[str], value: Any) -> None:
    """Set ``data[path[0]]...[path[-1]] = value``, creating mappings on the way."""
    node = data
    for part in path[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[path[-1]] = value


def check_sections(cls: type, data: Mapping[str, Any], prefix: str = "") -> None:
    """ConfigError naming the key where ``data`` gives a scalar or list for a nested section of ``cls``
    (``loss: openclip`` instead of ``loss: {kind: openclip}``), before anything reads the section."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in data or not dataclasses.is_dataclass(hints.get(f.name)):
            continue
        value, key = data[f.name], f"{prefix}{f.name}"
        if not isinstance(value, Mapping):
            keys = ", ".join(g.name for g in dataclasses.fields(hints[f.name])[:4])
            raise ConfigError(
                "config",
                key,
                f"is a section: expected a mapping of its keys ({keys}, ...), got "
                f"{type(value).__name__} {str(value)[:80]!r}",
            )
        check_sections(hints[f.name], value, key + ".")


def read_yaml(path: str | Path) -> dict:
    """Read a YAML mapping; errors name the file."""
    from toolkit.core.files import open_file

    try:
        with open_file(str(path), "r") as fh:
            data = safeyaml.load(fh)
    except FileNotFoundError as err:
        raise ConfigError(str(path), "", "file not found") from err
    except safeyaml.DuplicateKey as err:
        raise ConfigError(f"{path}:{err.line}", err.key, str(err)) from None
    except OSError as err:  # a FIFO (check_regular), a folder, no permission: one line naming the file
        raise ConfigError(str(path), "", err.strerror or str(err).removeprefix(f"{path} ")) from None
    except yaml.YAMLError as err:
        raise ConfigError(str(path), "", f"invalid YAML: {' '.join(str(err).split())}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            str(path),
            "",
            f"not UTF-8 text (byte 0x{err.object[err.start]:02x} at position "
            f"{err.start}); save the file as UTF-8",
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), "", f"expected a mapping at the top level, got {type(data).__name__}")
    return data


def load_config(
    cls: type[T],
    yaml_path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    explicit: Mapping[str, Any] | None = None,
    explicit_sources: Mapping[str, str] | None = None,
) -> T:
    """defaults < YAML file < ``--set`` overrides < explicit (CLI option) values; returns ``cls``.

    ``explicit`` maps config keys (dotted for nested fields) to values; None means "not given".
    ``explicit_sources`` says what set each explicit key, as errors should name it (the CLI passes the
    real flag, e.g. ``{'num_threads': 'option --threads'}``); keys without one are named 'explicit value'.
    Errors name where the offending value came from: the file, the ``--set`` text, or the option.
    """
    default_source = str(yaml_path) if yaml_path else "command line"
    data = read_yaml(yaml_path) if yaml_path else {}
    sources: dict[str, str] = {}
    for text in overrides:
        path, value = parse_override(text)
        set_path(data, path, value)
        sources[".".join(path)] = f"--set {text}"
    for key, value in (explicit or {}).items():
        if value is not None:
            path = key.split(".")
            set_path(data, path, value)
            sources[".".join(path)] = (explicit_sources or {}).get(key, "explicit value")
    try:
        check_sections(cls, data)
        return build(cls, data, source=default_source)
    except ConfigError as err:
        matches = [k for k in sources if err.key == k or err.key.startswith((k + ".", k + "["))]
        source = sources[max(matches, key=len)] if matches else default_source
        raise ConfigError(source, err.key, err.message) from None
