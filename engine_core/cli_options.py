"""Command-line flags generated from configuration dataclasses, and the help formatter of every
``mini-deepinfer`` command.

A configuration field becomes a flag by carrying ``flag(...)`` in its metadata: the help text, the
flag names (default ``--field-name``; vLLM's names and short forms go here), and how the help
states a default that is resolved later (``default_help``: such a flag's own default is ``None``, so
that the resolver, e.g. ``engine_config_from_args`` for ``--device``, can tell it was not given).
The flag's type and default otherwise come from the field itself, so the dataclass is the one place
an option is declared:

    max_num_seqs: int = field(default=64, metadata=flag("running sequences per DP rank"))

Booleans are ``store_true`` flags, or a ``--x`` / ``--no-x`` pair when ``negative`` is given (a
tri-state ``bool | None`` field is left ``None`` unless one of the two is given).

``HelpFormatter`` appends ``(default: ...)`` to every option's help (``default_text``), so
``--help`` and docs/configuration.md (``deploy/config_doc.py``) state every default the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from dataclasses import dataclass
from typing import Any

_FLAG_KEY = "cli_flag"


@dataclass(frozen=True)
class Flag:
    help: str
    names: tuple[str, ...] = ()  # default: ("--field-name",)
    default_help: str | None = None  # the default as --help states it, when the field's value is resolved later
    negative: str | None = None  # booleans: the flag that sets False ("--no-zos"); None: a store_true flag only
    choices: tuple[str, ...] | None = None
    metavar: str | None = None


def flag(help: str, **kwargs) -> dict[str, Flag]:
    """Metadata for ``dataclasses.field``: this field is a command-line flag."""
    return {_FLAG_KEY: Flag(help, **kwargs)}


def flag_of(field: dataclasses.Field) -> Flag | None:
    return field.metadata.get(_FLAG_KEY)


def _base_type(annotation) -> tuple[type, bool]:
    """(the value type, whether it is a tuple of them) of ``int | None``, ``tuple[str, ...]``, ..."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(args[0])
    if typing.get_origin(annotation) is tuple:
        return typing.get_args(annotation)[0], True
    return annotation, False


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, title: str, description: str | None = None,
                        skip: tuple[str, ...] = ()) -> argparse._ArgumentGroup:
    """One argument group holding a flag for every field of ``cls`` that carries ``flag(...)``."""
    group = parser.add_argument_group(title, description)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        spec = flag_of(field)
        if spec is None or field.name in skip:
            continue
        names = spec.names or (f"--{field.name.replace('_', '-')}",)
        default = None if field.default is dataclasses.MISSING else field.default
        kind, is_tuple = _base_type(hints[field.name])
        if kind is bool:
            target = group.add_mutually_exclusive_group() if spec.negative else group
            action = target.add_argument(*names, dest=field.name, action="store_true", default=default,
                                         help=spec.help)
            action.default_text = spec.default_help or ("on" if default else "off")
            if spec.negative:
                negative = target.add_argument(spec.negative, dest=field.name, action="store_false", default=default,
                                               help=f"the opposite of {names[0]}")
                negative.default_text = f"{names[0]} {action.default_text}"
        else:
            if spec.default_help is not None:  # resolved later: None tells the resolver the flag was not given
                default = None
            action = group.add_argument(*names, dest=field.name, type=kind, default=default, help=spec.help,
                                        choices=spec.choices, metavar=spec.metavar, nargs="+" if is_tuple else None)
            if spec.default_help is not None:
                action.default_text = spec.default_help
    return group


def values_from_args(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of ``cls`` found in parsed arguments (tuples for ``nargs="+"`` lists)."""
    values = {}
    for field in dataclasses.fields(cls):
        if hasattr(args, field.name):
            value = getattr(args, field.name)
            values[field.name] = tuple(value) if isinstance(value, list) else value
    return values


_WRITTEN_DEFAULT = re.compile(r"\s*\(default: ([^)]*)\)")


def default_text(action: argparse.Action) -> str | None:
    """How the help states an option's default ("required" for a required one); None for
    positionals, -h and --version. A help text that states its default itself is taken at its word."""
    if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return None
    if action.required and action.option_strings:
        return "required"
    text = getattr(action, "default_text", None)
    if text is not None:
        return text
    written = _WRITTEN_DEFAULT.search(action.help or "")
    if written:
        return written.group(1)
    if not action.option_strings:
        return None
    if isinstance(action, argparse._StoreTrueAction):
        return "off"
    if isinstance(action, argparse._StoreFalseAction):
        return "on"
    if action.default is None or action.default is argparse.SUPPRESS:
        return "not set"
    if isinstance(action.default, (list, tuple)):
        return " ".join(str(v) for v in action.default)
    return str(action.default)


def help_without_default(help_text: str | None) -> str:
    """A help text without a "(default: ...)" it states itself (the docs give defaults a column)."""
    return _WRITTEN_DEFAULT.sub("", help_text or "")


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default (or "(required)")."""

    def __init__(self, prog: str, **kwargs):
        kwargs.setdefault("max_help_position", 40)
        super().__init__(prog, **kwargs)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = default_text(action)
        help_text = action.help or ""
        if text is None or _WRITTEN_DEFAULT.search(help_text):
            return help_text
        suffix = "(required)" if text == "required" else f"(default: {text.replace('%', '%%')})"
        return f"{help_text} {suffix}" if help_text else suffix


class ArgumentParser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit code 2 (``prog: error: message (see --help)``)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
