"""The ``toolkit`` command. Start-up imports only typer: torch and friends load inside commands."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from toolkit import __version__
from toolkit.cli import data, eval, export, pipeline, plan, train

app = typer.Typer(
    name="toolkit",
    help="cliptk: train CLIP models on limited hardware and evaluate them zero-shot.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(data.app, name="data")
app.add_typer(train.app, name="train")
app.add_typer(eval.app, name="eval")
app.add_typer(pipeline.app, name="pipeline")
app.add_typer(plan.app, name="plan")
app.command("export")(export.export)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"cliptk {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    # metavar "": flags take no value, so the help shows no type (Typer would print `<bool>`)
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, metavar="", help="Print the version and exit."
        ),
    ] = False,
    log_level: Annotated[
        str, typer.Option("--log-level", help="DEBUG, INFO, WARNING or ERROR.", case_sensitive=False)
    ] = "INFO",
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", metavar="", help="No progress bars; warnings and errors only.")
    ] = False,
) -> None:
    """Options here apply to every command: `toolkit --quiet data fetch ...`."""
    from toolkit.core.log import setup_logging

    if log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise typer.BadParameter(f"unknown log level {log_level!r}", param_hint="--log-level")
    setup_logging(log_level, quiet)


# Options of the root callback that may also be written after the subcommand (`toolkit data fetch ... -q`);
# click only accepts them before it, and silently took `--quiet` at the end for an error (issue 15 item 17).
ROOT_FLAGS = ("--quiet", "-q")
ROOT_VALUE_OPTIONS = ("--log-level",)


def hoist_root_options(argv: list[str]) -> list[str]:
    """``argv`` with the root options found after the subcommand moved to the front (not after ``--``)."""
    front, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            rest += argv[i:]
            break
        if arg in ROOT_FLAGS or arg.split("=", 1)[0] in ROOT_VALUE_OPTIONS:
            takes_value = arg in ROOT_VALUE_OPTIONS and i + 1 < len(argv)
            front += argv[i : i + 1 + takes_value]
            i += 1 + takes_value
            continue
        rest.append(arg)
        i += 1
    return front + rest


def main() -> None:
    from toolkit.core.procs import stop_on_signals

    stop_on_signals()  # SIGTERM/SIGHUP stop cleanly like Ctrl-C: no orphaned children, manifest "interrupted"
    app(args=hoist_root_options(sys.argv[1:]))


if __name__ == "__main__":  # `python -m toolkit.cli.main`, as `python -m toolkit` (worker re-imports skip it)
    main()
