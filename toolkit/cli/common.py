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
    import dataclasses

    from toolkit.core.config import ConfigError, input_paths
    from toolkit.core.pathguard import check_url_schemes

    try:
        if dataclasses.is_dataclass(cfg):  # unknown schemes and missing fsspec backends, named before any work
            out = getattr(cfg, "out", "")
            check_url_schemes(type(cfg).__name__, {**input_paths(cfg), **({"out": out} if out else {})})
        return run(cfg)
    except ConfigError as err:
        fail(str(err))
    except ImportError as err:  # an optional package a path or option needs (fsspec names it: "Install s3fs")
        fail(f"{type(err).__name__}: {err}", code=2)
    except (OSError, RuntimeError, ValueError) as err:
        fail(f"{type(err).__name__}: {err}", code=1)
    except KeyboardInterrupt as err:
        from toolkit.core.procs import exit_code

        fail(str(err) or "interrupted (Ctrl-C); finished work is kept, rerun the same command to resume",
             code=exit_code(err))


def config_parameters(cls: type, flags: dict[str, tuple[str, ...]]) -> list[Any]:
    """Typer options for config fields of ``cls``: {dotted field: its flags} -> keyword-only
    ``inspect.Parameter``s named after the field (``a.b`` -> ``a_b``), typed and documented from the field
    itself (its ``option(doc=...)`` and default), so a flag cannot drift from the field it sets: a field
    that is renamed or removed fails here, when the command module is imported. Every option defaults to
    None (not given: the config's own layers decide). Lists are given comma-separated; Literal and union
    fields as text, which the config validates."""
    import inspect
    import typing

    params = []
    for key, names in flags.items():
        field, tp = config_field(cls, key)
        cli_type = tp if tp in (int, float, str, bool) else str
        listed = " Comma-separated." if typing.get_origin(tp) is list else ""
        help_text = f"{field.metadata.get('doc', '').rstrip()}{listed} {_default_text(field)}".strip()
        option = typer.Option(*names, help=help_text, show_default=False)
        params.append(inspect.Parameter(key.replace(".", "_"), inspect.Parameter.KEYWORD_ONLY,
                                        default=None, annotation=Annotated[cli_type | None, option]))
    return params


def config_field(cls: type, key: str) -> tuple[Any, Any]:
    """(dataclasses.Field, resolved type) of dotted ``key`` in config class ``cls``; TypeError if none."""
    import dataclasses
    import typing

    owner, parts = cls, key.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else {}
        if part not in fields:
            raise TypeError(f"{cls.__name__} has no config field {key!r} (at {part!r}): a command option names a "
                            "field that does not exist; rename the option's key to the field it sets")
        tp = typing.get_type_hints(owner)[part]
        if i == len(parts) - 1:
            return fields[part], tp
        owner = tp
    raise AssertionError("unreachable")


def _default_text(field: Any) -> str:
    import dataclasses

    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "(required)"
    if value in ("", [], ()):
        return ""
    return f"(default: {value})"


def with_parameters(params: list[Any]) -> Callable[[Callable], Callable]:
    """Give a command function (``def cmd(ctx, ..., **options)``) the extra keyword-only ``params`` in its
    signature, which Typer reads to build the command's options (``config_parameters``)."""
    import inspect

    def decorate(func: Callable) -> Callable:
        sig = inspect.signature(func, eval_str=True)
        own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
        func.__signature__ = sig.replace(parameters=[*own, *params])
        return func

    return decorate
