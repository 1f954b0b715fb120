"""Which call format a config asks for (`ReToolConfig.call_format`): the format object the rollout asks, the stop
string the engines need, and what the rewards need to find the model's own prose."""

from __future__ import annotations

from .calls import stop_format
from .prompts import Tags
from .tool_calls import ToolCallFormat, ToolProse


def call_format_from_config(args, tokenizer=None):
    """The call format of a `ReToolConfig` (or any object with `call_format` and the four tags); `tool_call` reads
    the tokenizer's chat template (and the config's `chat_template_kwargs`)."""
    name = getattr(args, "call_format", "tags")
    if name == "tool_call":
        if tokenizer is None:
            raise ValueError("call_format='tool_call' needs the tokenizer")
        return ToolCallFormat(tokenizer, getattr(args, "chat_template_kwargs", None))
    return stop_format(name, Tags.from_config(args))


def call_stop(args) -> str | None:
    """The stop string the engines stop a turn at for a config's call format (`None`: the turn's own end)."""
    name = getattr(args, "call_format", "tags")
    return None if name == "tool_call" else stop_format(name, Tags.from_config(args)).stop


def prose_format(args):
    """What the rewards need of a config's call format, without a tokenizer: its `model_prose`."""
    if getattr(args, "call_format", "tags") == "tool_call":
        return ToolProse()
    return stop_format(getattr(args, "call_format", "tags"), Tags.from_config(args))


__all__ = ["call_format_from_config", "call_stop", "prose_format"]
