"""The text format's shared facts: the tags, the shipped system prompts' names and how a system message is added.

A leaf module (no imports from the package, no TRL): the config, the parsers, the data adapters and the command line
all read their defaults from here, so each fact is written once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tags:
    """The four tags of the text format (defaults: the ReTool paper's)."""

    code_start: str = "<code>"
    code_end: str = "</code>"
    interpreter_start: str = "<interpreter>"
    interpreter_end: str = "</interpreter>"

    @classmethod
    def from_config(cls, args) -> Tags:
        """The tags of any object with the four tag attributes (`ReToolConfig`, script arguments)."""
        return cls(args.code_start, args.code_end, args.interpreter_start, args.interpreter_end)


# The names of the system prompts shipped with the package (`system_prompt: retool`). Each call format words each
# of them for itself (`CallFormat.prompts`): the model is told the format it must write.
SHIPPED_PROMPTS = ("retool", "retool_concise")


def add_system_message(messages: list, system_prompt: str | None) -> list:
    """`messages` with a leading system message holding `system_prompt`, unless it has one already or the prompt is
    empty/`None`."""
    if not system_prompt or (messages and messages[0].get("role") == "system"):
        return list(messages)
    return [{"role": "system", "content": system_prompt}, *messages]


def add_system_prompt(prompt, system_prompt: str | None):
    """One prompt with `system_prompt` added: as a system message to a conversation, or before a plain-text prompt
    (separated by a blank line)."""
    if isinstance(prompt, str):
        return f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
    return add_system_message(list(prompt), system_prompt)


# Written next to a model saved by `ReToolTrainer`: how its prompts were built, so that `retool-trl eval` of that
# model builds them the same way without being told.
PROMPT_SETTINGS = "retool_prompt.json"
PROMPT_SETTING_FIELDS = ("system_prompt", "chat_template_kwargs", "call_format", *Tags.__dataclass_fields__)
# How the interpreter answered in training: the model reads its results in this shape, so evaluation runs it so too.
INTERPRETER_SETTING_FIELDS = (
    "max_tool_calls",
    "max_interpreter_output_chars",
    "interpreter_truncation",
    "interpreter_errors",
    "max_cell_chars",
)


def write_prompt_settings(folder, args, dataset=None) -> None:
    """Writes `folder/retool_prompt.json`: the prompt and interpreter settings of `args` (a `ReToolConfig`, or the
    arguments of `retool-trl sft`: the fields it has) and the prompt format of the training data (`conversational` or
    `plain`, from its first row; absent when it cannot be read ahead)."""
    import json
    from pathlib import Path

    fields = (*PROMPT_SETTING_FIELDS, *INTERPRETER_SETTING_FIELDS)
    settings = {name: getattr(args, name) for name in fields if hasattr(args, name)}
    try:
        first = dataset[0]["prompt"] if dataset is not None and len(dataset) else None
    except (TypeError, KeyError, IndexError):  # an IterableDataset, or no `prompt` column
        first = None
    if first is not None:
        settings["prompt_format"] = "plain" if isinstance(first, str) else "conversational"
    path = Path(folder) / PROMPT_SETTINGS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=2, default=str) + "\n")


def read_prompt_settings(folder) -> dict:
    """The prompt settings a model folder records (`write_prompt_settings`), `{}` when it records none."""
    import json
    from pathlib import Path

    path = Path(folder) / PROMPT_SETTINGS
    if not path.is_file():
        return {}
    try:
        settings = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return settings if isinstance(settings, dict) else {}


__all__ = [
    "INTERPRETER_SETTING_FIELDS",
    "PROMPT_SETTINGS",
    "SHIPPED_PROMPTS",
    "Tags",
    "add_system_message",
    "add_system_prompt",
    "read_prompt_settings",
    "write_prompt_settings",
]
