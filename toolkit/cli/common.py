"""Option aliases shared by every command, and the one way commands turn errors into exit codes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

T = TypeVar("T")

ConfigFile = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="YAML file with this command's config (defaults < file < --set < options).",
                 dir_okay=False),
]
SetOverrides = Annotated[
    list[str] | None,
    typer.Option("--set", "-s", help="Override one config key, KEY=VALUE with dotted keys (repeatable), "
                                     "e.g. --set optim.lr=1e-3."),
]


def fail(message: str, code: int = 2) -> None:
    """Print an error line to stderr and exit with ``code`` (2: bad input, 1: a run failed)."""
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


def load_cli_config(cls: type[T], config: Path | None, overrides: list[str] | None, **explicit: Any) -> T:
    """Build ``cls`` from defaults < --config < --set < explicit options; config errors exit 2."""
    from toolkit.core.config import ConfigError, load_config

    try:
        return load_config(cls, config, overrides or [], explicit)  # it ignores options left at None
    except ConfigError as err:
        fail(str(err))
        raise  # unreachable; keeps type checkers happy


def run_stage(run: Callable[[T], Any], cfg: T) -> Any:
    """Call a stage's run(cfg); config errors exit 2, other failures exit 1 with the message."""
    from toolkit.core.config import ConfigError

    try:
        return run(cfg)
    except ConfigError as err:
        fail(str(err))
    except (OSError, RuntimeError, ValueError) as err:
        fail(f"{type(err).__name__}: {err}", code=1)
