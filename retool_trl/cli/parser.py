"""TRL's `TrlParser`, wrapped once so that every input mistake is one line naming the key and the fix.

`TrlParser.parse_args_and_config` reads `--config FILE.yaml`, sets its `env` variables and takes its values as the
defaults of the command-line options, so command-line values win over the file. It stores YAML values as they are;
this wrapper checks each one against the option it sets (unknown keys get a "did you mean" hint, values go through
the option's own type and choices) so a typo fails before anything is loaded instead of deep inside training.
"""

from __future__ import annotations

import argparse
import difflib
import typing
import warnings
from collections.abc import Mapping, Sequence

from trl.scripts.utils import TrlParser

from ..errors import UserError, one_line
from .help import OneDefaultFormatter, OneLineParser


def _accepts(hint, kind: type) -> bool:
    """Whether a (possibly Optional/Union) type hint accepts values of `kind` (list or dict)."""
    if hint is kind or typing.get_origin(hint) is kind:
        return True
    return typing.get_origin(hint) is not kind and any(_accepts(arg, kind) for arg in typing.get_args(hint))


def _expected(action) -> str:
    if action.choices is not None:
        return f"one of {list(action.choices)}"
    name = getattr(action.type, "__name__", "")
    return {"string_to_bool": "true or false", "int": "an integer", "float": "a number", "str": "a string"}.get(
        name, "a valid value"
    )


class ArgumentParser(TrlParser):
    """`TrlParser` over `dataclass_types` whose errors are `UserError`s (one line, no usage block).

    Args:
        dataclass_types: The dataclasses whose fields are the options.
        prog (`str`): The command, for messages (`retool-trl train`).
    """

    def __init__(self, dataclass_types: Sequence[type], prog: str):
        super().__init__(dataclass_types, prog=prog, allow_abbrev=False, formatter_class=OneDefaultFormatter)
        # Listed first in --help (TRL reads `--config FILE` itself before argparse parses the rest).
        config = self.add_argument(
            "--config",
            metavar="FILE.yaml",
            default=argparse.SUPPRESS,
            help="YAML file of options; command-line values override it.",
        )
        self._optionals._group_actions.remove(config)
        self._optionals._group_actions.insert(1, config)
        self._hints = {}
        for dtype in dataclass_types:
            self._hints.update(typing.get_type_hints(dtype))
        self._config_path = None

    def error(self, message):
        raise UserError(f"{message} (see `{self.prog} --help`)")

    def _options(self) -> dict[str, argparse.Action]:
        options: dict[str, argparse.Action] = {}
        for action in self._actions:  # the first action of a dest is its `--name` (a `--no_name` one follows)
            if action.option_strings and action.dest not in ("help", "config"):
                options.setdefault(action.dest, action)
        return options

    def set_defaults_with_config(self, **config) -> list[str]:
        """Checks and converts the YAML values, then sets them as defaults (called by `parse_args_and_config`)."""
        options = self._options()
        for key in config:
            if key not in options:
                close = difflib.get_close_matches(key, list(options), n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise UserError(
                    f"unknown key {key!r} in {self._config_path}: {hint}remove it or see `{self.prog} --help` for "
                    "valid keys."
                )
        converted = {key: self._from_yaml(options[key], key, value) for key, value in config.items()}
        return super().set_defaults_with_config(**converted)

    def _from_yaml(self, action, key: str, value):
        """A YAML value as the command line would have given it, or a `UserError` naming the key."""
        where = f"{key!r} in {self._config_path}"
        hint = self._hints.get(key)
        if value is None or (key == "resume_from_checkpoint" and isinstance(value, bool)):
            return value  # transformers: resume_from_checkpoint=True is the last checkpoint in output_dir
        many = action.nargs in ("+", "*")
        if (
            isinstance(value, dict)
            and _accepts(hint, dict)
            or isinstance(value, list)
            and not many
            and _accepts(hint, list)
        ):
            return value
        if isinstance(value, (dict, list)) and not many:
            raise UserError(f"{where} takes a single value ({_expected(action)}), got {value!r}.")
        converted = [self._scalar(action, item, where) for item in (value if isinstance(value, list) else [value])]
        return converted if many else converted[0]

    @staticmethod
    def _scalar(action, value, where: str):
        if action.type is None:
            return value
        wants_bool = getattr(action.type, "__name__", "") == "string_to_bool"
        if isinstance(value, bool) and not wants_bool:
            quote = " (YAML reads yes/no/on/off as booleans: quote the value)" if action.type is str else ""
            raise UserError(f"{where} must be {_expected(action)}, got {value!r}{quote}.")
        if action.type is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        try:
            converted = action.type(value if isinstance(value, str) else str(value))
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            raise UserError(f"{where} must be {_expected(action)}, got {value!r}.") from None
        if action.choices is not None and converted not in action.choices:
            raise UserError(f"{where} must be one of {list(action.choices)}, got {value!r}.")
        return converted

    def _check_config_file(self, args: list[str]) -> None:
        """Names a missing, unreadable or non-mapping config file (TRL would raise a bare exception)."""
        if "--config" not in args:
            return
        at = args.index("--config")
        if at + 1 >= len(args):
            raise UserError("--config needs a YAML file path.")
        import yaml

        path = self._config_path = args[at + 1]
        try:
            with open(path) as handle:
                config = yaml.safe_load(handle)
        except FileNotFoundError:
            raise UserError(f"config file {path!r} does not exist.") from None
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            line = f" at line {mark.line + 1}" if mark is not None else ""
            raise UserError(
                f"config file {path!r} is not valid YAML{line}: {getattr(error, 'problem', error)}."
            ) from None
        if config is None:  # an empty file sets nothing
            del args[at : at + 2]
        elif not isinstance(config, dict):
            raise UserError(f"config file {path!r} must be a YAML mapping of `key: value` lines.")
        elif not isinstance(config.get("env", {}), dict):
            raise UserError(f"'env' in {path} must be a mapping of environment variables.")

    def parse(self, argv: Sequence[str], defaults: Mapping | None = None) -> tuple:
        """Instances of the dataclasses from `argv` (with an optional `--config FILE.yaml`).

        Command-line values win over the YAML file, which wins over `defaults` and the dataclass defaults.

        Raises:
            UserError: an unknown key or argument (with the closest valid one), a value of the wrong type, or a
                check of a dataclass's `__post_init__`.
        """
        args = list(argv)
        self._check_config_file(args)
        if defaults:
            self.set_defaults(**defaults)
        with warnings.catch_warnings():
            # transformers warns about TRL's own `gradient_checkpointing` default on every parse: not the user's doing.
            warnings.filterwarnings(
                "ignore", message=".*gradient_checkpointing.* is deprecated", category=FutureWarning
            )
            try:
                *outputs, remaining = self.parse_args_and_config(args, return_remaining_strings=True)
            except UserError:
                raise
            except (ValueError, TypeError) as error:  # raised by the configs' __post_init__ checks
                message = one_line(error)
                if "bf16" in message and "use_cpu" in message:
                    message += " (on a machine without a GPU set `bf16: false` and `use_cpu: true`)"
                raise UserError(message) from None
        if remaining:
            options = [a for a in remaining if a.startswith("-")] or remaining
            known = [s for a in self._actions for s in a.option_strings]
            close = difflib.get_close_matches(options[0].split("=")[0], known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UserError(f"unknown argument {options[0]!r}: {hint}see `{self.prog} --help`.")
        return tuple(outputs)


def parse_arguments(dataclass_types: Sequence[type], argv: Sequence[str], prog: str, defaults: Mapping | None = None):
    """Parses `argv` into instances of `dataclass_types` with [`ArgumentParser`] (see `ArgumentParser.parse`)."""
    return ArgumentParser(dataclass_types, prog).parse(argv, defaults)


__all__ = ["ArgumentParser", "OneLineParser", "parse_arguments"]
