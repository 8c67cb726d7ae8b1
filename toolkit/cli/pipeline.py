"""``toolkit pipeline``: run stages chained by a YAML file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from toolkit.cli.common import fail
from toolkit.cli.options import config_keys

app = typer.Typer(help="Run and check YAML pipelines of toolkit stages.", no_args_is_help=True)

SetOverrides = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="Override a value of the file (repeatable): vars.NAME=V, run_dir=DIR, "
        "name=NAME or stages.STAGE.KEY=V (a key of the stage's config).",
    ),
]
PipelineFile = Annotated[Path, typer.Argument(help="Pipeline YAML file.", dir_okay=False)]


@app.command("run")
def run_cmd(
    file: PipelineFile,
    start: Annotated[
        str | None,
        typer.Option(
            "--from", help="Rerun this stage and every later one; earlier stages must have finished."
        ),
    ] = None,
    only: Annotated[
        str | None,
        typer.Option("--only", help="Rerun this one stage; the stages it reads from must have finished."),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Validate and print what would run or be skipped; run nothing.")
    ] = False,
    overrides: SetOverrides = None,
) -> None:
    """Validate the whole pipeline, then run its stages in order, skipping those already done."""
    from toolkit.core.config import ConfigError
    from toolkit.pipeline.load import load_pipeline
    from toolkit.pipeline.runner import PipelineError, run_pipeline

    if start and only:
        fail("--from and --only exclude each other")
    try:
        pipe = load_pipeline(str(file), overrides or [])
        report = run_pipeline(pipe, start=start, only=only, dry_run=dry_run)
    except ConfigError as err:
        fail(str(err))
    except PipelineError as err:
        fail(str(err), code=1)
    except KeyboardInterrupt as err:
        from toolkit.core.procs import exit_code

        why = str(err).split(";")[0] if str(err) else "interrupted (Ctrl-C)"
        fail(f"{why}; finished stages are kept, rerun to resume", code=exit_code(err))
    for name, action, _ in report:
        typer.echo(f"{name}: {action}")
    _print_last_report(report)


def _print_last_report(report: list) -> None:
    """Print the markdown report of the last stage that ran and wrote one (e.g. eval.zeroshot's table)."""
    for _, _, result in reversed(report):
        path = (result.outputs.get("report", "") if result is not None else "") or ""
        if path.endswith(".md") and Path(path).is_file():
            typer.echo("\n" + Path(path).read_text(encoding="utf-8"))
            typer.echo(f"(this table: {path})")
            return


@app.command("validate")
def validate_cmd(file: PipelineFile, overrides: SetOverrides = None) -> None:
    """Check kinds, keys, types and references of every stage without running anything."""
    from toolkit.core.config import ConfigError
    from toolkit.pipeline.load import load_pipeline

    try:
        pipe = load_pipeline(str(file), overrides or [])
    except ConfigError as err:
        fail(str(err))
    typer.echo(f"{file}: {len(pipe.stages)} stages valid: {', '.join(s.name for s in pipe.stages)}")


@app.command("kinds")
def kinds_cmd(
    kind: Annotated[str | None, typer.Argument(help="Show this kind's config keys.")] = None,
) -> None:
    """List the stage kinds a pipeline may use, or one kind's config keys with their docs."""
    from toolkit.pipeline.kinds import KINDS

    if kind is None:
        for name, spec in KINDS.items():
            typer.echo(f"{name:18} {spec.doc}")
        return
    if kind not in KINDS:
        fail(f"unknown stage kind {kind!r}; known: {', '.join(KINDS)}")
    rows = config_keys(KINDS[kind].load("config"))  # a section's keys follow it: augment, augment.scale_min
    width = max(len(key) for key, _, _ in rows)
    for key, doc, shown in rows:
        default = shown if shown in ("required", "section") else "default " + shown
        typer.echo(f"{key:{width}} {doc} ({default})")
    typer.echo(f"outputs: {', '.join(KINDS[kind].outputs)}")
