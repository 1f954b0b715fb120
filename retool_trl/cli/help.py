"""`--help` a person can read: `--config` first, the command's own options by topic, then a pointer to the rest.

TRL's parser lists every `GRPOConfig`/`TrainingArguments`/`ModelConfig` field (about 1,500 lines, and it has to
import torch and transformers to do so). `retool-trl train --help` instead lists the options a ReTool user sets,
grouped (model and data, rollout, sandbox, rewards, stability), each with one default, from dataclasses that import
neither torch nor TRL's trainers, so it prints in well under a second; `--help-all` prints TRL's full list.
"""

from __future__ import annotations

import argparse
import dataclasses
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence

HELP_FLAGS = ("-h", "--help")
HELP_ALL = "--help-all"


def wants_help(argv: Sequence[str]) -> bool:
    """Whether `argv` asks for the short help (and not for `--help-all`)."""
    return any(a in HELP_FLAGS for a in argv) and HELP_ALL not in argv


def help_all_argv(argv: Sequence[str]) -> list[str]:
    """`argv` with `--help-all` turned into the `--help` of the full parser (TRL's every option)."""
    return ["--help" if a == HELP_ALL else a for a in argv]


class OneDefaultFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds `(default: ...)` only to options whose help does not already say what the default is, and not for a
    default of `None` (the help says what happens then)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or action.default in (None, argparse.SUPPRESS, dataclasses.MISSING):
            return text
        return super()._get_help_string(action)


def _metavar(hint, spec: dataclasses.Field) -> str:
    choices = spec.metadata.get("choices")
    if choices:
        return "{" + ",".join(map(str, choices)) + "}"
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else hint
    if hint is bool:
        return "{true,false}"
    if typing.get_origin(hint) is list:
        return "NAME [NAME ...]"
    return {int: "INT", float: "FLOAT"}.get(hint, "TEXT")


def _default(spec: dataclasses.Field):
    if spec.default_factory is not dataclasses.MISSING:
        value = spec.default_factory()
        return " ".join(map(str, value)) if isinstance(value, list) else value
    return str(spec.default).lower() if isinstance(spec.default, bool) else spec.default


def render_help(
    prog: str,
    description: str,
    sections: Sequence[tuple[str, Sequence[str]]],
    sources: Sequence[type],
    overrides: Mapping[str, str] | None = None,
    epilog: str = "",
) -> str:
    """The short help of a command.

    Args:
        prog (`str`): The command (`retool-trl train`).
        description (`str`): What it does, in a sentence or two.
        sections (`list[tuple[str, list[str]]]`): `(title, option names)` in the order shown.
        sources (`list[type]`): Dataclasses whose fields are the options (the first one defining a name wins).
        overrides (`dict[str, str]`, *optional*): Help texts that replace a field's (for TRL's own fields).
        epilog (`str`): Text after the options (the pointer to `--help-all`).
    """
    fields: dict[str, tuple[object, dataclasses.Field]] = {}
    for source in sources:
        hints = typing.get_type_hints(source)
        for spec in dataclasses.fields(source):
            fields.setdefault(spec.name, (hints[spec.name], spec))
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} --config FILE.yaml [--option VALUE ...]",
        description=description,
        epilog=epilog,
        add_help=False,
        formatter_class=lambda prog: OneDefaultFormatterRaw(prog, max_help_position=36, width=100),
    )
    config = parser.add_argument_group("config")
    config.add_argument("--config", metavar="FILE.yaml", help="YAML file of options; command-line values override it.")
    config.add_argument("-h", "--help", action="store_true", default=None, help="This help.")
    config.add_argument(HELP_ALL, action="store_true", default=None, help="Every option, TRL's and transformers' too.")
    for title, names in sections:
        group = parser.add_argument_group(title)
        for name in names:
            hint, spec = fields[name]
            text = (overrides or {}).get(name, spec.metadata.get("help", ""))
            group.add_argument(f"--{name}", metavar=_metavar(hint, spec), default=_default(spec), help=text)
    return parser.format_help()


def more_options(prog: str, config_class: str, names: str) -> str:
    """The closing lines of a short help: the TRL/transformers options most set, and where the rest are listed."""
    listed = textwrap.fill(
        " ".join(f"--{name}" for name in names.split()), 96, initial_indent="  ", subsequent_indent="  "
    )
    return (
        f"Every field of TRL's {config_class} (with transformers' TrainingArguments) and of ModelConfig (LoRA) is an\n"
        f"option too; the most used are below. All of them, with help: {prog} --help-all\n{listed}"
    )


class OneLineParser(argparse.ArgumentParser):
    """Plain argparse (for commands without dataclasses) that raises `UserError` instead of printing usage. Here, not
    in `parser`, so that a command's `--help` does not import TRL's parser."""

    def error(self, message):
        from ..errors import UserError

        raise UserError(f"{message} (see `{self.prog} --help`)")


class OneDefaultFormatterRaw(OneDefaultFormatter):
    """[`OneDefaultFormatter`] that keeps the line breaks of the description and the epilog."""

    def _fill_text(self, text, width, indent):
        return argparse.RawDescriptionHelpFormatter._fill_text(self, text, width, indent)


__all__ = [
    "HELP_ALL",
    "OneDefaultFormatter",
    "OneLineParser",
    "help_all_argv",
    "more_options",
    "render_help",
    "wants_help",
]
