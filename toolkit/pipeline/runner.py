"""YAML pipelines: stages chained by reference, validated whole before anything runs.

File format::

    name: quickstart                  # optional
    run_dir: runs/quickstart          # default: runs/<file stem>; ${run_dir} in values
    vars: {size: 32}                  # ${vars.size} in values
    stages:
      - name: fetch
        kind: data.fetch              # a key of toolkit.pipeline.kinds.KINDS
        config: {urls: "${stages.demo.outputs.train_urls}", out: "${run_dir}/raw"}

A value that is exactly one ``${...}`` keeps the referenced value's type; otherwise references are
formatted into the string. ``out`` defaults to ``${run_dir}/<stage name>``. A stage is skipped when
its manifest says done with the same config hash and input fingerprints, so a rerun resumes at the
first failed or changed stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from toolkit.core import files
from toolkit.core.config import ConfigError, build, short, suggest
from toolkit.core.config_load import parse_override, read_yaml, set_path
from toolkit.core.log import get_logger, jsonl_log
from toolkit.core.stage import StageResult, fingerprints_once, read_manifest, up_to_date
from toolkit.pipeline import shellrefs
from toolkit.pipeline.kinds import KINDS

_REF = re.compile(r"\$\{([^}]+)\}")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")
TOP_KEYS = ["name", "run_dir", "vars", "stages"]
STAGE_KEYS = ["name", "kind", "config"]


class PipelineError(RuntimeError):
    """A stage failed; ``stage`` names it."""

    def __init__(self, stage: str, message: str):
        self.stage = stage
        super().__init__(f"stage {stage!r} failed: {message}")


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


def _substitute(value: Any, lookup, source: str, key: str, shell_key: str = "") -> Any:
    """Replace ``${...}`` in strings (recursively) using ``lookup(ref, key) -> value``; the string at
    the string at ``shell_key`` (a shell stage's cmd) gets environment variables instead
    (:func:`_shell_cmd`)."""
    if isinstance(value, dict):
        out = {
            k: _substitute(v, lookup, source, f"{key}.{k}", shell_key)
            for k, v in value.items()
            if f"{key}.{k}" != shell_key
        }
        if shell_key == f"{key}.cmd" and "cmd" in value:
            out["cmd"] = _shell_cmd(value["cmd"], out, lambda ref: lookup(ref, shell_key), source, shell_key)
        return out
    if isinstance(value, list):
        return [_substitute(v, lookup, source, f"{key}[{i}]", shell_key) for i, v in enumerate(value)]
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
    raw = _substitute(
        config,
        _static_lookup(path, run_dir, variables, earlier, refs, sources),
        path,
        f"{where}.config",
        _shell_key(kind, config, where),
    )
    cls = KINDS[kind].load("config")
    if "out" in {f.name for f in dataclasses.fields(cls)} and "out" not in raw:
        raw["out"] = f"{run_dir}/{name}"
    placeholder = _substitute(raw, lambda ref, key: f"<{ref}>", path, where)
    build(cls, placeholder, source=path, prefix=f"{where}.config")
    return Stage(name, kind, raw, refs)


def _shell_key(kind: str, config: dict, where: str) -> str:
    """The key path of a shell stage's cmd, whose references are quoted, unless ``quote_refs: false``."""
    return f"{where}.config.cmd" if kind == "shell" and config.get("quote_refs", True) is not False else ""


def resolve_stage(pipe: Pipeline, stage: Stage, results: dict[str, dict[str, str]]) -> Any:
    """Build the stage's config with earlier stages' outputs (from this run or their manifests)."""

    def lookup(ref: str, key: str) -> Any:
        _, name, _, out_key = ref.split(".")
        if name not in results:
            src = next(s for s in pipe.stages if s.name == name)
            m = read_manifest(_stage_out(pipe, src, results)) or {}
            if m.get("status") != "done":
                raise ConfigError(
                    pipe.path, key, f"stage {name!r} has not finished; run it first (drop --from/--only)"
                )
            results[name] = m.get("outputs") or {}
        if out_key not in results[name]:
            raise ConfigError(pipe.path, key, f"stage {name!r} recorded no output {out_key!r}")
        return results[name][out_key]

    where = f"stages.{stage.name}"
    data = _substitute(
        stage.raw, lookup, pipe.path, f"{where}.config", _shell_key(stage.kind, stage.raw, where)
    )
    return build(
        KINDS[stage.kind].load("config"), data, source=pipe.path, prefix=f"stages.{stage.name}.config"
    )


def _stage_out(pipe: Pipeline, stage: Stage, results: dict) -> str:
    out = stage.raw.get("out", "")
    return out if "${" not in str(out) else str(resolve_stage(pipe, stage, results).out)


def select(pipe: Pipeline, start: str | None = None, only: str | None = None) -> tuple[list[Stage], bool]:
    """Stages to consider and whether they are forced (``--from``/``--only`` rerun what they name)."""
    if only:
        return [pipe.stages[pipe.index(only)]], True
    if start:
        return pipe.stages[pipe.index(start) :], True
    return pipe.stages, False


def _step(
    stage: Stage, cfg: Any, forced: bool, dry_run: bool
) -> tuple[str, StageResult | None, dict[str, str]]:
    """Check one stage and run it unless it is up to date (or ``dry_run``): (action, result, its outputs)."""
    log = get_logger("pipeline")
    fresh, why = up_to_date(stage.kind, cfg, cfg.out)
    action = "run (forced)" if forced else ("skip: " + why if fresh else "run: " + why)
    if dry_run or (fresh and not forced):
        if dry_run:
            log.info("%-16s %-16s %s", stage.name, stage.kind, action)
        else:
            log.info("stage %s (%s): skipped, %s", stage.name, stage.kind, why)
        return action if dry_run else "skipped", None, (read_manifest(cfg.out) or {}).get("outputs") or {}
    log.info("stage %s (%s): running (%s)", stage.name, stage.kind, action)
    try:
        result = KINDS[stage.kind].load("run")(cfg)
    except Exception as err:
        raise PipelineError(stage.name, _failure(stage, err)) from err
    return "ran" if result.status == "done" else result.status, result, result.outputs


def _failure(stage: Stage, err: Exception) -> str:
    """A failed stage's one line. An error that knows a better remedy in pipeline terms restates itself
    through ``in_pipeline(stage_name)`` (a train checkpoint refused for another configuration: the
    ``--resume none`` of ``toolkit train`` is no option of ``pipeline run``)."""
    restate = getattr(err, "in_pipeline", None)
    if callable(restate):
        err = restate(stage.name)
    return f"{type(err).__name__}: {err}"


def _make_run_dir(pipe: Pipeline) -> None:
    """Create ``run_dir``; one that cannot be created or written to is a ConfigError naming it."""
    try:
        files.makedirs(pipe.run_dir)
        if files.is_local(pipe.run_dir):  # fail here, not with a traceback from the first log write
            with tempfile.TemporaryFile(dir=files.local_path(pipe.run_dir)):
                pass
    except OSError as err:
        raise ConfigError(
            pipe.path, "run_dir", f"cannot write to {pipe.run_dir}: {err.strerror or err}"
        ) from None


def run_pipeline(
    pipe: Pipeline, *, start: str | None = None, only: str | None = None, dry_run: bool = False
) -> list[tuple[str, str, StageResult | None]]:
    """Run (or plan, with ``dry_run``) the selected stages in order; returns (name, action, result).

    Raises :class:`PipelineError` at the first failing stage; finished stages' outputs stay. Stops, without
    an error, after a stage that ended short of done (a preempted train stage: rerun to continue).
    """
    stages, forced = select(pipe, start, only)
    results: dict[str, dict[str, str]] = {}
    report: list[tuple[str, str, StageResult | None]] = []
    planned: set[str] = set()  # dry run: stages that would run, so their new outputs are unknown
    if not dry_run:  # a dry run writes nothing, not even run_dir
        _make_run_dir(pipe)
    with contextlib.nullcontext() if dry_run else jsonl_log(files.join(pipe.run_dir, "pipeline.log.jsonl")):
        for stage in stages:
            if stage.refs & planned:  # only in a dry run: its config needs outputs that do not exist yet
                action = "run (forced)" if forced else "run: after " + ", ".join(sorted(stage.refs & planned))
                get_logger("pipeline").info("%-16s %-16s %s", stage.name, stage.kind, action)
                report.append((stage.name, action, None))
                planned.add(stage.name)
                continue
            cfg = resolve_stage(pipe, stage, results)
            with fingerprints_once():  # the run records the input fingerprints the check measured
                action, result, results[stage.name] = _step(stage, cfg, forced, dry_run)
            if dry_run and not action.startswith("skip"):
                planned.add(stage.name)
            report.append((stage.name, action, result))
            if result is not None and result.status != "done":  # e.g. preempted: later stages need it done
                get_logger("pipeline").warning(
                    "stage %s %s; stopping here: rerun the pipeline to continue", stage.name, result.status
                )
                break
    if dry_run:
        return report
    files.write_text_atomic(
        files.join(pipe.run_dir, "pipeline.resolved.yaml"),
        yaml.safe_dump(
            {
                "name": pipe.name,
                "run_dir": pipe.run_dir,
                "stages": [{"name": s.name, "kind": s.kind, "config": s.raw} for s in pipe.stages],
            },
            sort_keys=False,
        ),
    )
    return report
