"""A session's limits as its request asks them, validated: a session gets exactly what it asked for (or the
server's defaults for what it left out) and the reply confirms them, or the request is refused with one line naming
the field and the range it must lie in. Nothing is clamped or rounded: a trainer whose cells would behave otherwise
than it asked learns so at once, not from scores."""

from __future__ import annotations

import math

from .config import ServerConfig

__all__ = ["MIN_MEMORY_MB", "MIN_OUTPUT_CHARS", "LimitError", "session_limits"]

MIN_OUTPUT_CHARS = 64  # room for the truncation marker and some text around it
MIN_MEMORY_MB = 64  # what an interpreter needs to start (as `LocalSandbox` needs)
FIELDS = ("timeout_s", "memory_mb", "max_output_chars", "show_last_expression")


class LimitError(ValueError):
    """A limit outside its range, of the wrong type, or a field no session has: the request is answered 400."""


def session_limits(body, config: ServerConfig) -> dict:
    """The limits of a `POST /sessions` body (`{}` or no body: the defaults), checked against `config`.

    Raises:
        `LimitError`: naming the field and its range.
    """
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise LimitError(f"send a JSON object with any of {', '.join(FIELDS)}")
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise LimitError(f"{unknown[0]} is not a session limit; the fields are {', '.join(FIELDS)}")
    timeout = _in_range(body, "timeout_s", config.timeout_s, 0.0, config.max_timeout_s, float, low_open=True)
    memory = _in_range(body, "memory_mb", config.memory_mb, MIN_MEMORY_MB, config.max_memory_mb, int)
    chars = _in_range(body, "max_output_chars", 4096, MIN_OUTPUT_CHARS, config.max_output_chars, int)
    show = body.get("show_last_expression", True)
    if not isinstance(show, bool):
        raise LimitError(f"show_last_expression must be true or false, got {show!r}")
    return {"timeout_s": timeout, "memory_mb": memory, "max_output_chars": chars, "show_last_expression": show}


def _in_range(body: dict, name: str, default, low, high, kind, low_open: bool = False):
    value = body.get(name)
    if value is None:
        return kind(default)
    span = f"{'(' if low_open else '['}{low:g}, {high:g}]"
    number = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if not number or (kind is int and value != int(value)):
        raise LimitError(f"{name} must be {'an integer' if kind is int else 'a number'} in {span}, got {value!r}")
    if value < low or (low_open and value == low) or value > high:
        raise LimitError(f"{name} must be in {span} on this server, got {value!r}")
    return kind(value)
