"""Option aliases shared by every command (``--config``, ``--set``), building a command's config, and the
one way commands turn errors into exit codes (``run_stage``, ``fail``).

The options generated from stage configs are in :mod:`toolkit.cli.options`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

T = TypeVar("T")


ConfigFile = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="YAML file with this command's config (defaults < file < --set < options).",
        dir_okay=False,
    ),
]


SetOverrides = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="Override one config key of this command, KEY=VALUE (dotted for nested "
        "keys; repeatable); the keys are those of its --config YAML, listed by "
        "`toolkit pipeline kinds KIND`.",
    ),
]


def fail(message: str, code: int = 2) -> None:
    """Print an error line to stderr and exit with ``code`` (2: bad input, 1: a run failed)."""
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    raise typer.Exit(code)


def load_cli_config(
    ctx: typer.Context,
    cls: type[T],
    config: Path | None,
    overrides: list[str] | None,
    labels: dict[str, str] | None = None,
    **explicit: Any,
) -> T:
    """Build ``cls`` from defaults < --config < --set < explicit options; config errors exit 2.

    Call it from a command (``ctx`` is the command's ``typer.Context``) with ``field=value`` for every
    option that sets a config field; each keyword must be the name of the command's parameter that
    carries it (a dotted field ``a.b`` is parameter ``a_b``), so that an error names the flag the user
    typed (``option --threads``), not the field. ``labels`` names the source of keys that one option
    splits into several fields (``--loss fastclip-v3`` sets loss.kind and loss.version).
    """
    from toolkit.core.config import ConfigError
    from toolkit.core.config_load import load_config

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
            raise TypeError(
                f"command {ctx.command.name!r} has no parameter named {key.replace('.', '_')!r} for "
                f"config key {key!r}; name the parameter after the field it sets"
            )
        if param.param_type_name == "option":
            flag = next((o for o in param.opts if o.startswith("--")), param.opts[0])
            labels[key] = "option " + "/".join([flag, *param.secondary_opts])
        else:
            labels[key] = f"argument {(param.metavar or param.name).upper()}"
    return labels


def score_lines(run_dir: str) -> list[str]:
    """The scores a training run's last evaluation computed, one line per set (`toolkit train` ended
    without them: they were only in metrics.jsonl)."""
    from toolkit.train.metrics import final_scores

    step, scores = final_scores(run_dir)
    by_set: dict[str, list[str]] = {}
    for key, value in scores.items():
        name, _, metric = key.rpartition("/")
        by_set.setdefault(name, []).append(f"{metric} {value:.4f}")
    if not by_set:
        return []
    return [
        f"zero-shot scores at step {step} (also in {run_dir}/metrics.jsonl):",
        *(f"  {name}: {', '.join(values)}" for name, values in by_set.items()),
    ]


def run_stage(run: Callable[[T], Any], cfg: T) -> Any:
    """Call a stage's run(cfg); config errors exit 2, other failures exit 1 with the message."""
    import dataclasses

    from toolkit.core.config import ConfigError, input_paths
    from toolkit.core.pathguard import check_url_schemes

    try:
        if dataclasses.is_dataclass(
            cfg
        ):  # unknown schemes and missing fsspec backends, named before any work
            out = getattr(cfg, "out", "")
            check_url_schemes(type(cfg).__name__, {**input_paths(cfg), **({"out": out} if out else {})})
        return run(cfg)
    except ConfigError as err:
        fail(str(err))
    except ImportError as err:  # an optional package a path or option needs (fsspec names it: "Install s3fs")
        fail(f"{type(err).__name__}: {err}", code=2)
    except (OSError, RuntimeError, ValueError) as err:
        from toolkit.core.procs import exit_code

        signum = getattr(err, "signum", None)  # a StageInterrupted that knows its signal: 128 + it
        disk = _full_disk_text(err, cfg) if isinstance(err, OSError) else ""
        fail(f"{type(err).__name__}: {err}{disk}", code=exit_code(err) if signum else 1)
    except KeyboardInterrupt as err:
        from toolkit.core.procs import exit_code

        fail(
            str(err) or "interrupted (Ctrl-C); finished work is kept, rerun the same command to resume",
            code=exit_code(err),
        )
    except Exception as err:  # noqa: BLE001 - only an HTTP client's error is turned into a line, others go up
        if not _network_error(err):
            raise
        fail(_unreachable_text(err, cfg), code=1)


def _network_error(err: BaseException) -> bool:
    from toolkit.core.files import is_network_error

    return is_network_error(err)


def _unreachable_text(err: BaseException, cfg: Any) -> str:
    """One line for an HTTP client's error that escaped a stage: the URLs of the stage's config (the
    client's own message names a host at best: "Connection refused")."""
    import dataclasses

    from toolkit.core.config import input_paths
    from toolkit.core.files import unreachable

    paths = {}
    if dataclasses.is_dataclass(cfg):
        paths = {**input_paths(cfg), "out": str(getattr(cfg, "out", "") or "")}
    urls = [
        f"{key} {value}" for key, value in paths.items() if "://" in value and not value.startswith("file://")
    ]
    return f"ConnectionError: {unreachable(', '.join(urls) or 'a URL', err)}"


def _full_disk_text(err: OSError, cfg: Any) -> str:
    """For a full disk that the error does not place (a write() names no file: a bare "[Errno 28] No space
    left on device"), where: the stage's output folder and the space left on its filesystem."""
    import errno
    import shutil

    out = str(getattr(cfg, "out", "") or "")
    if err.errno not in (errno.ENOSPC, errno.EDQUOT) or err.filename or not out or "://" in out:
        return ""
    folder = Path(out).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = f"{shutil.disk_usage(folder).free:,} bytes free there"
    except OSError:
        free = "its free space unreadable"
    return f" (while writing --out {out}: {free}); free space on that filesystem or choose another --out"
