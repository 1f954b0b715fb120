"""The `markdown` format: a ```` ```python ```` block, answered by an ```` ```output ```` fence (the Zero-RL line of
work: ToRL, SimpleTIR, ZeroTIR, whose base models write it without a cold start).

Generation stops at a closing fence followed by a newline, which an opening fence (```` ```python ````) never
matches. A closing fence whose block was not opened as Python (a bare ```` ``` ```` fence, a ```` ```text ````
block) is not a call: the model goes on.
"""

from __future__ import annotations

import re
import textwrap

from .calls import Call, SFTTrace, StopFormat
from .convert import trace_cells
from .prompts import Tags
from .registry import register_format

_OPENING = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\r?\n")
PYTHON_LANGUAGES = ("python", "python3", "py", "py3")


@register_format
class MarkdownFormat(StopFormat):
    """```` ```python ```` code blocks, answered by an ```` ```output ```` fence (see the module docstring)."""

    name = "markdown"
    summary = "```python blocks, ```output fences"
    writes = "```` ```python ```` + code + ```` ``` ````"
    answered_by = "```` ```output ```` + output + ```` ``` ````"
    stops_at = "a closing fence followed by a newline"
    prompts = {
        "retool": (
            "Solve the problem step by step. You have a Python interpreter: to run code, write it in a ```python "
            "block. Generation stops after the closing fence, the code runs in a persistent session (variables and "
            "imports carry over between calls), and what it prints is returned in an ```output block. Use the "
            "interpreter for exact computation and to check your reasoning; print the values you need. When you are "
            "done, write the final answer once as \\boxed{{answer}}."
        ),
        "retool_concise": (
            "Use ```python blocks for any computation; their output appears in ```output blocks. End with the final "
            "answer in \\boxed{{}}."
        ),
    }

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

    @classmethod
    def sft_trace(cls, completion: str, tags: Tags = Tags()) -> SFTTrace:
        return SFTTrace(text=to_markdown(completion, tags), spans=MARKDOWN_TAGS)


# The markdown format as tags, for the span splitting of SFT traces (the output fence is the environment's span).
MARKDOWN_TAGS = Tags("```python\n", MarkdownFormat.stop, "```output\n", "\n```\n")


def to_markdown(completion: str, tags: Tags = Tags()) -> str:
    """The trace with ```` ```python ```` blocks and ```` ```output ```` fences in place of the tags."""
    pieces = []
    for prose, code, output in trace_cells(completion, tags):
        pieces.append(prose)
        if code is not None:
            newline = "" if not prose or prose.endswith("\n") else "\n"
            pieces.append(f"{newline}```python\n{code}\n```\n")
            if output is not None:
                pieces.append(f"```output\n{output.rstrip(chr(10))}\n```\n")
    return "".join(pieces)


__all__ = ["MARKDOWN_TAGS", "PYTHON_LANGUAGES", "MarkdownFormat", "to_markdown"]
