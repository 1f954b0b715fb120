"""The one registry of call formats: the config's and the command line's choices, their validation, their help and
the docs' formats table all come from here (the choices and validation at each use; the help text lists the formats
registered when the command line's options are defined, built-ins and entry-point plugins).

`register_format` refuses, when the class is registered, a format that would fail later: a name already taken, a
missing summary or docs cell, or a shipped system prompt the format does not word for itself (a model told to write
`<code>` while the rollout waits for something else learns nothing, and no error would say why).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from .calls import CallFormat
from .prompts import SHIPPED_PROMPTS, Tags

logger = logging.getLogger(__name__)
_FORMATS: dict[str, type[CallFormat]] = {}
_DESCRIBED_BY = ("summary", "writes", "answered_by", "stops_at")
# Formats other packages declare (`[project.entry-points."retool_trl.call_formats"]`), loaded at the first lookup.
ENTRY_POINT_GROUP = "retool_trl.call_formats"
_plugins_loaded = False


def _formats() -> dict[str, type[CallFormat]]:
    """The registered formats, after loading those other packages declare (once: importing a plugin's module
    registers its class; a class its module leaves unregistered is registered here)."""
    global _plugins_loaded
    if not _plugins_loaded:
        _plugins_loaded = True
        from importlib.metadata import entry_points

        for entry in entry_points(group=ENTRY_POINT_GROUP):
            try:
                cls = entry.load()
                if getattr(cls, "name", None) not in _FORMATS:
                    register_format(cls)
            except Exception as error:  # noqa: BLE001 - one broken plugin must not hide the built-in formats
                logger.warning("call format plugin %s could not be loaded: %s", entry.value, error)
    return _FORMATS


def register_format(cls: type[CallFormat]) -> type[CallFormat]:
    """Registers a call format class (usable as a class decorator); it is then a valid `call_format` everywhere."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise TypeError(f"call format {cls.__name__}: `name` must be an identifier, got {name!r}.")
    if name in _FORMATS and _FORMATS[name] is not cls:
        raise ValueError(f"call format {name!r} is already registered ({_FORMATS[name].__name__}).")
    if not issubclass(cls, CallFormat):
        raise TypeError(f"call format {name!r}: {cls.__name__} must subclass retool_trl.format.CallFormat.")
    missing = [attr for attr in _DESCRIBED_BY if not getattr(cls, attr, None)]
    if missing:
        raise TypeError(f"call format {name!r}: set {', '.join(missing)} (the help and the docs' table read them).")
    prompts = getattr(cls, "prompts", None) or {}
    unworded = [prompt for prompt in SHIPPED_PROMPTS if not prompts.get(prompt)]
    if unworded:
        raise TypeError(
            f"call format {name!r} has no system prompt of its own for {', '.join(unworded)}: word each shipped "
            "prompt for this format in `prompts` (another format's prompt would tell the model to write that one)."
        )
    for prompt in SHIPPED_PROMPTS:
        cls.system_prompt(prompt)  # a placeholder other than the four tags fails now, not at the first step
    _FORMATS[name] = cls
    return cls


def unregister_format(name: str) -> None:
    """Removes a registered format (for tests and plugins that register one for a while)."""
    _FORMATS.pop(name, None)


class _Names(Sequence):
    """The registered names, in registration order, read at each use (so a format registered later is a choice of
    the config and of the command line's parsers built before it)."""

    def __getitem__(self, index):
        return list(_formats())[index]

    def __len__(self) -> int:
        return len(_formats())

    def __repr__(self) -> str:
        return repr(list(_formats()))


FORMAT_NAMES: Sequence[str] = _Names()


def get_format(name: str) -> type[CallFormat]:
    """The registered format class called `name`; a `ValueError` naming the choices otherwise."""
    formats = _formats()
    try:
        return formats[name]
    except (KeyError, TypeError):
        raise ValueError(f"call_format must be one of {', '.join(formats)}, got {name!r}.") from None


def format_of(args) -> type[CallFormat]:
    """The format class a config asks for (`call_format`, default `tags`)."""
    return get_format(getattr(args, "call_format", None) or "tags")


def formats_help() -> str:
    """The registered formats in one line, for the config's and the command line's help."""
    return ", ".join(f"'{name}' ({cls.summary})" for name, cls in _formats().items())


def formats_table() -> str:
    """The docs' formats table (Markdown), from the registered classes."""
    rows = ["| format | the model writes | the result comes back as | a turn stops at |", "|---|---|---|---|"]
    for i, (name, cls) in enumerate(_formats().items()):
        label = f"`{name}`" + (" (default)" if i == 0 else "")
        rows.append(f"| {label} | {cls.writes} | {cls.answered_by} | {cls.stops_at} |")
    return "\n".join(rows)


def resolve_system_prompt(name_or_text: str | None, tags: Tags = Tags(), call_format: str = "tags") -> str | None:
    """The system prompt text for a setting: a shipped name (worded for `call_format`, the tags filled in), a
    literal prompt used as written, or `None` for `None`/`"none"`."""
    if name_or_text is None or name_or_text.strip().lower() == "none":
        return None
    if name_or_text in SHIPPED_PROMPTS:
        return get_format(call_format).system_prompt(name_or_text, tags)
    return name_or_text


__all__ = [
    "ENTRY_POINT_GROUP",
    "FORMAT_NAMES",
    "format_of",
    "formats_help",
    "formats_table",
    "get_format",
    "register_format",
    "resolve_system_prompt",
    "unregister_format",
]
