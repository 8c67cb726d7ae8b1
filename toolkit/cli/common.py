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
    typer.Option("--set", "-s", help="Override one config key of this command, KEY=VALUE (dotted for nested "
                                     "keys; repeatable); the keys are those of its --config YAML, listed by "
                                     "`toolkit pipeline kinds KIND`."),
]


def fail(message: str, code: int = 2) -> None:
    """Print an error line to stderr and exit with ``code`` (2: bad input, 1: a run failed)."""
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


def load_cli_config(ctx: typer.Context, cls: type[T], config: Path | None, overrides: list[str] | None,
                    labels: dict[str, str] | None = None, **explicit: Any) -> T:
    """Build ``cls`` from defaults < --config < --set < explicit options; config errors exit 2.

    Call it from a command (``ctx`` is the command's ``typer.Context``) with ``field=value`` for every
    option that sets a config field; each keyword must be the name of the command's parameter that
    carries it (a dotted field ``a.b`` is parameter ``a_b``), so that an error names the flag the user
    typed (``option --threads``), not the field. ``labels`` names the source of keys that one option
    splits into several fields (``--loss fastclip-v3`` sets loss.kind and loss.version).
    """
    from toolkit.core.config import ConfigError, load_config

    sources = {**parameter_labels(ctx, [k for k in explicit if k not in (labels or {})]), **(labels or {})}
    try:
        return load_config(cls, config, overrides or [], explicit, sources)  # it ignores options left at None
    except ConfigError as err:
        fail(str(err))
        raise  # unreachable; keeps type checkers happy


def parameter_labels(ctx: typer.Context, keys: list[str]) -> dict[str, str]:
    """Config key -> the command's parameter of the same name as errors name it: 'option --threads',
    'option --overwrite/--resume', 'argument DIRECTORY'. A key with no such parameter is a bug in the
    command (its errors would name the wrong flag), so it raises at every call, not only on bad input."""
    params = {p.name: p for p in ctx.command.params}
    labels = {}
    for key in keys:
        param = params.get(key.replace(".", "_"))
        if param is None:
            raise TypeError(f"command {ctx.command.name!r} has no parameter named {key.replace('.', '_')!r} for "
                            f"config key {key!r}; name the parameter after the field it sets")
        if param.param_type_name == "option":
            flag = next((o for o in param.opts if o.startswith("--")), param.opts[0])
            labels[key] = "option " + "/".join([flag, *param.secondary_opts])
        else:
            labels[key] = f"argument {(param.metavar or param.name).upper()}"
    return labels


def run_stage(run: Callable[[T], Any], cfg: T) -> Any:
    """Call a stage's run(cfg); config errors exit 2, other failures exit 1 with the message."""
    from toolkit.core.config import ConfigError

    try:
        return run(cfg)
    except ConfigError as err:
        fail(str(err))
    except (OSError, RuntimeError, ValueError) as err:
        fail(f"{type(err).__name__}: {err}", code=1)
    except KeyboardInterrupt:
        fail("interrupted (Ctrl-C); finished work is kept, rerun the same command to resume", code=130)
