"""How the model calls the interpreter: one small object per call format (`ReToolConfig.call_format`).

The rollout asks a format three things, and nothing else about the text: where a call ends (`stop`, or the end of an
assistant turn for `calls_at_turn_end`), what code a finished turn carries (`calls`), and which ids the results
insert (`result_ids`). The rewards ask it what the model wrote outside its calls and their results (`model_prose`).
So the two rollout loops, the engines, the mask and the rewards stay the same for every format:

- `tags` ([`TagFormat`]): the ReTool paper's inline tags, `<code>...</code>` answered by
  `<interpreter>...</interpreter>`;
- `markdown` ([`MarkdownFormat`]): a ```` ```python ```` block, answered by an ```` ```output ```` fence (the Zero-RL
  line of work: ToRL, SimpleTIR, ZeroTIR). Generation stops at a closing fence followed by a newline, which an
  opening fence (```` ```python ````) never matches;
- `tool_call` (`tool_calls.ToolCallFormat`): the chat template's own tool calls to a `code_interpreter` tool, parsed
  and rendered with TRL's pieces (it needs the tokenizer, so it lives in its own module).

Strings only here: no torch, no TRL.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

from .parsing import clean_output, extract_code, remove_first_spans
from .prompts import Tags

CALL_FORMATS = ("tags", "tool_call", "markdown")


@dataclass(frozen=True)
class Call:
    """One call the model made in a turn: the code to run, or (`code is None`) the reason it could not be read,
    which the model is shown as the call's result (its error, counted as one)."""

    code: str | None
    error: str | None = None
    counted: bool = True  # False for a call past the limit: answered without running, not counted


class StopFormat:
    """A format whose call ends at a stop string written by the model (`tags`, `markdown`).

    The engines stop a turn at the token completing `stop`; that token may carry characters after the stop (with a
    byte-level BPE, `</code>` is often completed by `><` or `>\\n\\n`). Those characters belong to the text that
    follows: the rollout keeps them (`carry`) and reads them as the start of the next turn.
    """

    name = "tags"
    stop: str | None = None
    calls_at_turn_end = False
    # Strings kept in the model's text even where a tokenizer registers them as special tokens.
    kept_texts: tuple[str, ...] = ()
    # (start, end) pairs of what is not the model's prose: its code and the results inserted for it.
    spans: tuple[tuple[str, str], ...] = ()
    # Strings that printed output must not contain (they could close the result early or open a call).
    guarded: tuple[str, ...] = ()

    def split(self, text: str) -> tuple[str, str] | None:
        """`(call text, carried text)` when `text` reached the stop: the call text ends with the stop, the rest is
        what the stop's last token carried. `None` when the turn did not reach the stop."""
        cut = text.find(self.stop) if self.stop else -1
        if cut < 0:
            return None
        end = cut + len(self.stop)
        return text[:end], text[end:]

    def calls(self, call_text: str) -> list[Call]:
        """The call that `call_text` (ending with the stop) closes: none when the stop closed no code block."""
        raise NotImplementedError

    def clean(self, output: str) -> str:
        """Printed output made safe to insert (valid text, every guarded string defanged)."""
        return clean_output(output, self.guarded)

    def result_texts(self, outputs: list[str]) -> tuple[str, str]:
        raise NotImplementedError

    def result_ids(self, tokenizer, outputs: list[list[str]]) -> list[list[int]]:
        """The ids each row's results insert (one list of cleaned, truncated outputs per row: one output per call).

        The output is encoded on its own with `split_special_tokens`, so text such as `<|endoftext|>` printed by code
        stays text and never becomes a control token; the frame around it is encoded as the tokenizer defines it.
        """
        if not outputs:  # never call the tokenizer on an empty batch
            return []
        start, end = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in self.result_texts([]))
        bodies = ["".join(row) for row in outputs]
        encoded = tokenizer(bodies, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return [[*start, *body, *end] for body in encoded]

    def model_prose(self, text: str) -> str:
        """The text the model wrote outside its calls and their results (where a final answer counts)."""
        return remove_first_spans(text, self.spans)


class TagFormat(StopFormat):
    """The ReTool paper's tags (configurable): `code_start` code `code_end`, answered by `interpreter_start` output
    `interpreter_end`."""

    name = "tags"

    def __init__(self, tags: Tags = Tags()):
        self.tags = tags
        self.stop = tags.code_end
        self.kept_texts = (tags.code_start, tags.code_end, tags.interpreter_start, tags.interpreter_end)
        self.spans = ((tags.code_start, tags.code_end), (tags.interpreter_start, tags.interpreter_end))
        self.guarded = self.kept_texts

    def calls(self, call_text: str) -> list[Call]:
        code = extract_code(call_text, self.tags)
        return [] if code is None else [Call(code)]

    def result_texts(self, outputs):
        return self.tags.interpreter_start, self.tags.interpreter_end


_OPENING = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\r?\n")
PYTHON_LANGUAGES = ("python", "python3", "py", "py3")


class MarkdownFormat(StopFormat):
    """```` ```python ```` code blocks, answered by an ```` ```output ```` fence.

    The turn stops at a closing fence followed by a newline (```` ```\\n ````): an opening fence carries its language
    (```` ```python\\n ````), so it never matches. A closing fence whose block was not opened as Python (a bare
    ```` ``` ```` fence, a ```` ```text ```` block) is not a call: the model goes on.
    """

    name = "markdown"
    stop = "```\n"
    kept_texts = ("```",)
    # A block ends where the call ended, at the stop (code may hold a fence inside a string: `print('```')`).
    spans = tuple((f"```{lang}", "```\n") for lang in (*PYTHON_LANGUAGES, "output"))
    guarded = ("```",)

    def calls(self, call_text: str) -> list[Call]:
        close = len(call_text) - len(self.stop)
        opening = None
        for match in _OPENING.finditer(call_text, 0, close + 1):
            if match.start() < close:
                opening = match
        if opening is None or opening.group(1).lower() not in PYTHON_LANGUAGES:
            return []
        code = call_text[opening.end() : close].replace("\r\n", "\n")
        return [Call(textwrap.dedent(code.strip("\n")))]

    def result_texts(self, outputs):
        return "```output\n", "\n```\n"

    def result_ids(self, tokenizer, outputs: list[list[str]]) -> list[list[int]]:
        # The output's own last newline is the fence's: `42\n` reads "```output\n42\n```".
        return super().result_ids(tokenizer, [[out.rstrip("\n") for out in row] for row in outputs])


def stop_format(call_format: str, tags: Tags = Tags()) -> StopFormat:
    """The string-only format for a `call_format` name; `tool_call` needs a tokenizer (`tool_calls.ToolCallFormat`)."""
    if call_format == "markdown":
        return MarkdownFormat()
    if call_format == "tags":
        return TagFormat(tags)
    raise ValueError(f"call_format must be one of {CALL_FORMATS}, got {call_format!r}")


__all__ = [
    "CALL_FORMATS",
    "Call",
    "MarkdownFormat",
    "StopFormat",
    "TagFormat",
    "stop_format",
]
