"""Command options generated from stage configs, so a flag cannot drift from the field it sets.

Every option that sets a config field is generated from that field (``config_parameters``): its type, its
help (the field's ``doc``) and the default it shows come from the config. ``ConfigOptions`` does this for
every field of a stage config (``data``, ``eval`` and ``plan``: a field added to the config becomes an
option), ``train`` for the fields its ``FLAGS`` table names. Typer builds options from a function's
signature: ``with_parameters`` sets the signature of ``train``'s function; ``config_command`` builds a
stage's options only when the command is used, so `toolkit --help` does not import the stage modules.
``config_keys`` and ``nested_keys_help`` list a config's keys for `toolkit pipeline kinds` and the help.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import typer

from toolkit.cli.common import fail


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
        cli_type = _cli_type(tp)
        listed = " Comma-separated." if typing.get_origin(tp) is list else ""
        doc = field.metadata.get("doc", "").rstrip()
        help_text = f"{doc}{listed}{_choices_text(tp)} {_default_text(field)}".strip()
        # a flag takes no value: no type column in the help (Typer would show `<bool>`)
        option = typer.Option(
            *names, help=help_text, show_default=False, metavar="" if cli_type is bool else None
        )
        params.append(
            inspect.Parameter(
                key.replace(".", "_"),
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[cli_type | None, option],
            )
        )
    return params


def _cli_type(tp: Any) -> type:
    """The type Typer parses an option as: the field's own scalar type (also of ``X | None``), else text
    (lists comma-separated, Literals and other unions validated by the config)."""
    import types
    import typing

    basic = (int, float, str, bool)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and args[0] in basic:
            return args[0]
    return tp if tp in basic else str


def _choices_text(tp: Any) -> str:
    """' One of: a, b, c.' for a Literal field (or a list of one), from the type itself."""
    import typing

    if typing.get_origin(tp) is list:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) is not Literal:
        return ""
    return " One of: " + ", ".join(str(a) for a in typing.get_args(tp)) + "."


def config_keys(cls: type, prefix: str = "", instance: Any = None) -> list[tuple[str, str, str]]:
    """(dotted key, doc, default text) of every key of config class ``cls``, a section's keys after its own
    line (``augment``, then ``augment.scale_min`` ...): what `toolkit pipeline kinds KIND` and `toolkit train
    --help` list. A key's default is the one its section's default holds (``instance``), where it has one."""
    import dataclasses
    import typing

    hints, rows = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        key, tp = prefix + f.name, hints[f.name]
        value = _field_default(f) if instance is None else getattr(instance, f.name)
        section = dataclasses.is_dataclass(tp)
        shown = (
            "section"
            if section
            else "required"
            if value is dataclasses.MISSING
            else "empty"
            if value in ("", [], (), {})
            else repr(value)
        )
        rows.append((key, f.metadata.get("doc", ""), shown))
        if section:
            rows += config_keys(tp, key + ".", None if value is dataclasses.MISSING else value)
    return rows


def _field_default(f: Any) -> Any:
    import dataclasses

    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def nested_keys_help(cls: type, flags: Mapping[str, Any], width: int = 76) -> str:
    """Help text (an epilog) naming every key of ``cls`` in a section that has no option of its own (the
    keys in ``flags`` have one), section by section with its default: `toolkit train --help` showed none
    of optim.*, augment.*, ... Lines are wrapped here and kept by click (``\\b``)."""
    import textwrap

    sections: dict[str, list[str]] = {}
    for key, _, shown in config_keys(cls):
        head, _, name = key.rpartition(".")
        if shown != "section" and key not in flags:
            sections.setdefault(head, []).append(f"{name}={shown}")
    lines = []
    for head, names in sections.items():
        lines += textwrap.wrap(
            (f"{head}.* : " if head else "top level: ") + ", ".join(names),
            width,
            subsequent_indent="    ",
            break_on_hyphens=False,
        )
    return (
        "Keys without an option, set with --set KEY=VALUE or in --config FILE.yaml (each key's doc: "
        "`toolkit pipeline kinds train`):\n\n\b\n" + "\n".join(lines)
    )


def config_field(cls: type, key: str) -> tuple[Any, Any]:
    """(dataclasses.Field, resolved type) of dotted ``key`` in config class ``cls``; TypeError if none."""
    import dataclasses
    import typing

    owner, parts = cls, key.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else {}
        if part not in fields:
            raise TypeError(
                f"{cls.__name__} has no config field {key!r} (at {part!r}): a command option names a "
                "field that does not exist; rename the option's key to the field it sets"
            )
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

    def decorate(func: Callable) -> Callable:
        func.__signature__ = _extended_signature(func, params)
        return func

    return decorate


def _extended_signature(func: Callable, params: list[Any]) -> Any:
    """``func``'s signature with its ``**options`` replaced by the keyword-only ``params``."""
    import inspect

    sig = inspect.signature(func, eval_str=True)
    own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    return sig.replace(parameters=[*own, *params])


@dataclass(frozen=True)
class ConfigOptions:
    """The options of a command that runs one stage: one per field of the stage's config class
    ``config`` ("module:Class", imported only when Typer builds the command, so `toolkit` starts without
    the stage's imports), except nested configs and the fields in ``exclude`` (those the command takes
    another way, e.g. as an argument). A field's flag is ``--field-name`` unless ``flags`` gives its
    flags (short aliases, historical names, ``--on/--off`` pairs); a nested config's field is an option
    only when ``flags`` names it by its dotted key (``"launch.nodes": ("--nodes",)``). A field added to the
    config becomes an option with no change here; tests/cli/test_config_flags.py checks every command against
    its config."""

    config: str
    flags: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    exclude: tuple[str, ...] = ()

    def cls(self) -> type:
        module, _, name = self.config.partition(":")
        return getattr(importlib.import_module(module), name)

    def all_flags(self) -> dict[str, tuple[str, ...]]:
        """{field: its flags} for every generated option, in the config's field order."""
        import dataclasses

        cls = self.cls()
        nested = {key: flags for key, flags in self.flags.items() if "." in key}  # a nested config's field
        unknown = set(self.flags) - set(nested) - {f.name for f in dataclasses.fields(cls)}
        if unknown:  # a renamed or removed field would otherwise leave its flag silently unused
            raise TypeError(
                f"{cls.__name__} has no config field(s) {sorted(unknown)}: rename the flags' keys"
            )
        for key in nested:
            config_field(cls, key)  # TypeError naming the key when the nested field does not exist
        types = {f.name: config_field(cls, f.name)[1] for f in dataclasses.fields(cls)}
        out = {}
        for name, tp in types.items():
            if name in self.exclude or dataclasses.is_dataclass(tp):
                continue
            flag = "--" + name.replace("_", "-")
            # a switch can be turned off too (a field whose default is true, or set so by --config)
            out[name] = tuple(self.flags.get(name, (f"{flag}/--no-{flag[2:]}",) if tp is bool else (flag,)))
        return out | {key: tuple(flags) for key, flags in nested.items()}

    def parameters(self) -> list[Any]:
        return config_parameters(self.cls(), self.all_flags())

    def click_params(self) -> list[Any]:
        """The options as Typer builds them (types, help, ``--on/--off`` pairs), through Typer's public
        ``typer.main.get_command`` on a one-command app whose signature holds only them."""
        import inspect

        def options_only(**_: Any) -> None:
            """Never called: it carries the signature."""

        options_only.__signature__ = inspect.Signature(self.parameters())  # type: ignore[attr-defined]
        app = typer.Typer(add_completion=False)
        app.command()(options_only)
        return list(typer.main.get_command(app).params)

    def values(self, ctx: typer.Context) -> dict[str, Any]:
        """The generated options' values as config values for ``load_cli_config`` (None: not given);
        comma-separated lists split (and their items made ints where the field holds ints)."""
        given = ctx.meta.get((_GIVEN, self.config), {})
        cls = self.cls()
        return {
            key: _list_value(cls, key, flags[0], given.get(key.replace(".", "_")))
            for key, flags in self.all_flags().items()
        }


def _list_value(cls: type, key: str, flag: str, value: Any) -> Any:
    import typing

    _, tp = config_field(cls, key)
    if value is None or typing.get_origin(tp) is not list:
        return value
    items = [part.strip() for part in str(value).split(",") if part.strip()]
    if typing.get_args(tp) == (int,):
        try:
            return [int(item) for item in items]
        except ValueError:
            fail(f"option {flag}: expected comma-separated integers, got {value!r}")
    return items


def config_command(options: ConfigOptions, group: bool = False) -> type:
    """The Click command class (Typer's ``cls=``) of a command whose config options are ``options``:
    ``@app.command("fetch", cls=config_command(FETCH))`` (a group's callback: ``typer.Typer(cls=...)``)."""
    from typer.core import TyperCommand, TyperGroup

    name = options.config.rpartition(":")[2] + ("Group" if group else "Command")
    return type(name, (_ConfigParams, TyperGroup if group else TyperCommand), {"config_options": options})


class _ConfigParams:
    """Adds the generated options to a Typer command when Click first asks for its parameters (parsing,
    help, completion), so listing commands (`toolkit --help`) does not import every stage's config module
    (and numpy, PIL, pyarrow with them). Their values are taken out of ``ctx.params`` before Typer calls the
    function (which declares only its own parameters) and handed over through ``ConfigOptions.values``."""

    config_options: ConfigOptions
    _generated: list[Any] | None = None

    def get_params(self, ctx: Any) -> list[Any]:
        if self._generated is None:
            self._generated = self.config_options.click_params()
            arguments = [p for p in self.params if p.param_type_name == "argument"]
            self.params = [*arguments, *self._generated, *(p for p in self.params if p not in arguments)]
        return super().get_params(ctx)  # type: ignore[misc]

    def invoke(self, ctx: Any) -> Any:
        names = [p.name for p in self._generated or ()]
        given = {n: ctx.params.pop(n) for n in names if n in ctx.params}
        ctx.meta[(_GIVEN, self.config_options.config)] = given
        return super().invoke(ctx)  # type: ignore[misc]


_GIVEN = "cliptk.config_options"
