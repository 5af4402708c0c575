"""Click options generated from a config dataclass (``TrainConfig``, ``EvalConfig``): one option per field, same name, default,
help, type and range, listed by section in ``--help``. An option cannot drift from its field because it is made
from it."""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import MISSING, Field, fields
from typing import Any

import click

from moeckpt.formats.backend import backend_names
from moeckpt.trainer.config import SECTIONS, choices_of, field_kind

from .common import FormatChoice
from .params import Number, Text

__all__ = ["SectionedCommand", "config_from_options", "config_options", "option_of"]


class SectionOption(click.Option):
    """A click option that knows the config section its field belongs to."""

    def __init__(self, *args: Any, section: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.section = section


class SectionedCommand(click.Command):
    """A command whose ``--help`` lists its options under one heading per config section."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups: dict[str | None, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            if not isinstance(param, click.Option):  # arguments are in the usage line (click 8.2 lists them too)
                continue
            record = param.get_help_record(ctx)
            if record is not None:
                groups.setdefault(getattr(param, "section", None), []).append(record)
        for section in (*SECTIONS, None):
            if groups.get(section):
                with formatter.section(f"{section.capitalize()} options" if section else "Other options"):
                    formatter.write_dl(groups[section])


def option_of(f: Field) -> str:
    """The spelling of field ``f``'s option (``--a/--b`` for a boolean pair)."""
    return f.metadata.get("option") or "--" + f.name.replace("_", "-")


def _default(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _option(f: Field, hints: dict[str, Any]) -> Callable:
    meta = f.metadata
    kind, _ = field_kind(f, hints)
    spelling = option_of(f)
    default = _default(f)
    kw: dict[str, Any] = {"help": meta["help"], "cls": SectionOption, "section": meta["section"]}
    if meta.get("metavar"):
        kw["metavar"] = meta["metavar"]
    if default is MISSING:
        kw["required"] = True
    elif default in ("", None, ()):
        kw["default"] = () if meta.get("multiple") else None  # nothing to convert: the field's own default applies
    else:
        kw["default"] = default
        kw["show_default"] = True
    if kind is bool:
        if "/" in spelling:
            return click.option(spelling, f.name, **kw)
        return click.option(spelling, f.name, is_flag=True, **kw)
    if meta.get("choices"):
        kw["type"] = FormatChoice() if meta["choices"] is backend_names else click.Choice(list(choices_of(meta) or ()))
    elif kind in (int, float):
        kw["type"] = Number(
            kind, meta.get("min"), meta.get("max"), lo_open=bool(meta.get("min_open")), none_as=meta.get("none_as")
        )
        if meta.get("none_as") and "default" in kw and kw["default"] is not None:
            kw["default"] = str(kw["default"])
    else:
        kw["type"] = Text(meta.get("pattern"), expect=meta.get("metavar"))
    if meta.get("multiple"):
        kw["multiple"] = True
    return click.option(spelling, f.name, **kw)


def config_options(cls: type, *, skip: tuple[str, ...] = ()) -> Callable:
    """Decorate a click command with one option per field of the dataclass ``cls``, in field order, but for the
    fields named in ``skip`` (which the command takes otherwise, e.g. as an argument)."""
    hints = typing.get_type_hints(cls)

    def decorate(fn: Callable) -> Callable:
        for f in reversed([f for f in fields(cls) if f.name not in skip]):
            fn = _option(f, hints)(fn)
        return fn

    return decorate


def config_from_options(cls: type, values: dict[str, Any]) -> Any:
    """The ``cls`` instance of the parsed option values; a field's refusal is a usage error naming its option."""
    kwargs = {}
    by_name = {f.name: f for f in fields(cls)}
    for name, value in values.items():
        f = by_name[name]
        if value is None or (f.metadata.get("multiple") and value == ()):
            default = _default(f)
            if default is not MISSING:
                value = default
        kwargs[name] = tuple(value) if f.metadata.get("multiple") else value
    try:
        return cls(**kwargs)
    except ValueError as e:
        message = " ".join(str(e).split())
        for f in fields(cls):
            if message.startswith(f"{f.name}=") or message.startswith(f"{f.name} "):
                message = f"{option_of(f).split('/')[0]}: {message}"
                break
        raise click.UsageError(message) from None
