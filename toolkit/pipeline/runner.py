"""Running a YAML pipeline (:mod:`toolkit.pipeline.load` reads and validates it): each selected stage's
config built with earlier stages' outputs, then run in order. A stage is skipped when its manifest says
done with the same config hash and input fingerprints, so a rerun resumes at the first failed or changed
stage.
"""

from __future__ import annotations

import contextlib
import tempfile
from typing import Any

import yaml

from toolkit.core import files
from toolkit.core.config import ConfigError, build
from toolkit.core.log import get_logger, jsonl_log
from toolkit.core.stage import StageResult, fingerprints_once, read_manifest, up_to_date
from toolkit.pipeline.kinds import KINDS
from toolkit.pipeline.load import Pipeline, Stage, shell_key, substitute


class PipelineError(RuntimeError):
    """A stage failed; ``stage`` names it."""

    def __init__(self, stage: str, message: str):
        self.stage = stage
        super().__init__(f"stage {stage!r} failed: {message}")


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
    data = substitute(
        stage.raw, lookup, pipe.path, f"{where}.config", shell_key(stage.kind, stage.raw, where)
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
