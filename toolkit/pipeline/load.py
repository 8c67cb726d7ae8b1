"""YAML pipelines: the file, loaded and validated whole before anything runs (:func:`load_pipeline`).

File format::

    name: quickstart                  # optional
    run_dir: runs/quickstart          # default: runs/<file stem>; ${run_dir} in values
    vars: {size: 32}                  # ${vars.size} in values
    stages:
      - name: fetch
        kind: data.fetch              # a key of toolkit.pipeline.kinds.KINDS
        config: {urls: "${stages.demo.outputs.train_urls}", out: "${run_dir}/raw"}

A value that is exactly one ``${...}`` keeps the referenced value's type; otherwise references are
formatted into the string. ``out`` defaults to ``${run_dir}/<stage name>``. Running the stages is
:mod:`toolkit.pipeline.runner`.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.core.config import ConfigError, build, short, suggest
from toolkit.core.config_load import parse_override, read_yaml, set_path
from toolkit.pipeline import shellrefs
from toolkit.pipeline.kinds import KINDS

_REF = re.compile(r"\$\{([^}]+)\}")


_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")


TOP_KEYS = ["name", "run_dir", "vars", "stages"]


STAGE_KEYS = ["name", "kind", "config"]


@dataclass
class Stage:
    name: str
    kind: str
    raw: dict  # config mapping with ${vars}/${run_dir} resolved, stage references still unresolved
    refs: set[str]  # names of earlier stages this one references


@dataclass
class Pipeline:
    path: str
    name: str
    run_dir: str
    stages: list[Stage]

    def index(self, name: str) -> int:
        names = [s.name for s in self.stages]
        if name not in names:
            raise ConfigError(self.path, name, "no such stage" + suggest(name, names))
        return names.index(name)


def substitute(value: Any, lookup, source: str, key: str, shell_key: str = "") -> Any:
    """Replace ``${...}`` in strings (recursively) using ``lookup(ref, key) -> value``; the string at
    the string at ``shell_key`` (a shell stage's cmd) gets environment variables instead
    (:func:`_shell_cmd`)."""
    if isinstance(value, dict):
        out = {
            k: substitute(v, lookup, source, f"{key}.{k}", shell_key)
            for k, v in value.items()
            if f"{key}.{k}" != shell_key
        }
        if shell_key == f"{key}.cmd" and "cmd" in value:
            out["cmd"] = _shell_cmd(value["cmd"], out, lambda ref: lookup(ref, shell_key), source, shell_key)
        return out
    if isinstance(value, list):
        return [substitute(v, lookup, source, f"{key}[{i}]", shell_key) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value
    whole = _REF.fullmatch(value)
    if whole:
        return lookup(whole.group(1).strip(), key)
    return _REF.sub(lambda m: str(lookup(m.group(1).strip(), key)), value)


def _shell_cmd(cmd: Any, config: dict, lookup, source: str, key: str) -> Any:
    """A shell stage's cmd with each reference as an environment variable whose value joins ``config``'s
    env (``shellrefs.substitute_cmd``): values never reach bash as shell text."""
    if not isinstance(cmd, str) or "${" not in cmd:
        return cmd
    try:
        text, env = shellrefs.substitute_cmd(cmd, _REF, lookup)
    except shellrefs.ShellRefError as err:
        raise ConfigError(source, key, str(err)) from None
    if env:
        user_env = config.get("env") or {}
        if not isinstance(user_env, dict):
            return text  # the config's own check names env's type
        config["env"] = {**user_env, **env}
    return text


def _static_lookup(
    path: str,
    run_dir: str,
    variables: dict,
    earlier: dict[str, Stage],
    refs: set[str],
    sources: dict[str, str],
):
    """``lookup(ref, key)`` for load time; a value that came from ``--set`` marks ``key`` as set by it."""

    def lookup(ref: str, key: str) -> Any:
        parts = ref.split(".")
        if ref in sources:
            sources.setdefault(key, sources[ref])
        if ref == "run_dir":
            return run_dir
        if parts[0] == "vars" and len(parts) == 2:
            if parts[1] not in variables:
                raise ConfigError(
                    path, key, f"unknown variable ${{{ref}}}" + suggest(parts[1], list(variables))
                )
            return variables[parts[1]]
        if parts[0] == "stages" and len(parts) == 4 and parts[2] == "outputs":
            if parts[1] not in earlier:
                raise ConfigError(
                    path,
                    key,
                    f"${{{ref}}} must name an earlier stage (forward references and "
                    f"cycles are not allowed); earlier: {', '.join(earlier) or 'none'}",
                )
            _check_output_key(path, key, earlier[parts[1]], parts[3])
            refs.add(parts[1])
            return "${" + ref + "}"  # resolved when the stage runs
        raise ConfigError(
            path,
            key,
            f"unknown reference ${{{ref}}}; use ${{run_dir}}, ${{vars.NAME}} or ${{stages.NAME.outputs.KEY}}",
        )

    return lookup


def _check_output_key(path: str, key: str, stage: Stage, out_key: str) -> None:
    kind = KINDS[stage.kind]
    known = list(kind.outputs) + (list(stage.raw.get("outputs") or {}) if stage.kind == "shell" else [])
    if out_key not in known:
        raise ConfigError(
            path,
            key,
            f"stage {stage.name!r} ({stage.kind}) has no output {out_key!r}" + suggest(out_key, known),
        )


def load_pipeline(path: str, overrides: list[str] | tuple[str, ...] = ()) -> Pipeline:
    """Parse and validate the whole file (kinds, keys, types, references); nothing runs.

    Errors name the ``--set`` text when the offending value came from one (directly or through a
    ``${vars.X}`` / ``${run_dir}`` it set), otherwise the file."""
    data = read_yaml(path)
    for key in data:
        if key not in TOP_KEYS:
            raise ConfigError(path, key, "unknown key" + suggest(str(key), TOP_KEYS))
    variables = data.get("vars") or {}
    if not isinstance(variables, dict):
        raise ConfigError(path, "vars", "expected a mapping")
    sources = _apply_overrides(path, data, overrides)
    for key in ("run_dir", "name"):
        if key in data and (not isinstance(data[key], str) or not data[key].strip()):
            raise ConfigError(
                sources.get(key, path), key, f"expected a non-empty string, got {short(data[key])}"
            )
    run_dir = data.get("run_dir") or f"runs/{Path(path).stem}"
    entries = data.get("stages")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(path, "stages", "expected a non-empty list of stages")
    stages: dict[str, Stage] = {}
    for i, entry in enumerate(entries):
        try:
            stage = _load_stage(path, i, entry, run_dir, variables, stages, sources)
        except ConfigError as err:
            blamed = [k for k in sources if err.key == k or err.key.startswith((k + ".", k + "["))]
            if err.source != path or not blamed:
                raise
            raise ConfigError(sources[max(blamed, key=len)], err.key, err.message) from None
        stages[stage.name] = stage
    return Pipeline(path, data.get("name") or Path(path).stem, run_dir, list(stages.values()))


def _apply_overrides(path: str, data: dict, overrides: list[str] | tuple[str, ...]) -> dict[str, str]:
    """Apply ``--set`` texts to the file's mapping; returns key path -> the ``--set`` text that set it."""
    sources: dict[str, str] = {}
    variables = data.get("vars") or {}
    entries = [s for s in data.get("stages") or [] if isinstance(s, dict)]
    for text in overrides:
        keys, value = parse_override(text)
        source, dotted = f"--set {text}", ".".join(keys)
        if keys[0] == "stages" and len(keys) >= 3:
            stage = next((s for s in entries if s.get("name") == keys[1]), None)
            if stage is None:
                raise ConfigError(
                    source, keys[1], "no such stage" + suggest(keys[1], [str(s.get("name")) for s in entries])
                )
            if stage.get("config") is None:
                stage["config"] = {}
            if not isinstance(stage["config"], dict):
                raise ConfigError(path, f"stages.{keys[1]}.config", "expected a mapping")
            set_path(stage["config"], keys[2:], value)
            sources[f"stages.{keys[1]}.config.{'.'.join(keys[2:])}"] = source
        elif keys[0] == "vars" and len(keys) == 2:
            if keys[1] not in variables:
                known = suggest(keys[1], list(variables)) if variables else "; the file's vars is empty"
                raise ConfigError(source, dotted, f"{path} defines no variable {keys[1]!r}{known}")
            variables[keys[1]] = value
            sources[dotted] = source
        elif keys[0] in ("run_dir", "name") and len(keys) == 1:
            data[keys[0]] = value
            sources[dotted] = source
        else:
            raise ConfigError(source, dotted, "use vars.NAME=V, run_dir=DIR, name=NAME or stages.STAGE.KEY=V")
    return sources


def _load_stage(
    path: str,
    i: int,
    entry: Any,
    run_dir: str,
    variables: dict,
    earlier: dict[str, Stage],
    sources: dict[str, str],
) -> Stage:
    where = f"stages[{i}]"
    if not isinstance(entry, dict):
        raise ConfigError(path, where, "expected a mapping with name, kind and config")
    for key in entry:
        if key not in STAGE_KEYS:
            raise ConfigError(path, f"{where}.{key}", "unknown key" + suggest(str(key), STAGE_KEYS))
    name, kind = entry.get("name"), entry.get("kind")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(
            path, f"{where}.name", f"expected a name of letters, digits, '_' or '-', got {short(name)}"
        )
    if name in earlier:
        raise ConfigError(path, f"{where}.name", f"duplicate stage name {name!r}")
    where = f"stages.{name}"
    if kind not in KINDS:
        raise ConfigError(
            path, f"{where}.kind", f"unknown stage kind {short(kind)}" + suggest(str(kind)[:80], list(KINDS))
        )
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ConfigError(path, f"{where}.config", "expected a mapping")
    refs: set[str] = set()
    raw = substitute(
        config,
        _static_lookup(path, run_dir, variables, earlier, refs, sources),
        path,
        f"{where}.config",
        shell_key(kind, config, where),
    )
    cls = KINDS[kind].load("config")
    if "out" in {f.name for f in dataclasses.fields(cls)} and "out" not in raw:
        raw["out"] = f"{run_dir}/{name}"
    placeholder = substitute(raw, lambda ref, key: f"<{ref}>", path, where)
    build(cls, placeholder, source=path, prefix=f"{where}.config")
    return Stage(name, kind, raw, refs)


def shell_key(kind: str, config: dict, where: str) -> str:
    """The key path of a shell stage's cmd, whose references are quoted, unless ``quote_refs: false``."""
    return f"{where}.config.cmd" if kind == "shell" and config.get("quote_refs", True) is not False else ""
