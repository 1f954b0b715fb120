"""Text helpers for the ReTool format: code extraction, interpreter blocks, model prose and `\\boxed{}` answers.

Everything here works on strings; token-level work (the interpreter mask) lives in `retool_trl.rollout`.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from dataclasses import astuple

from .prompts import Tags, add_system_message

# ```python, ```python3, ```py, ```py3 (any case) or a bare ```.
_FENCE = re.compile(r"^\s*```[ \t]*(?:python3?|py3?)?[ \t]*\n(.*?)\n?```\s*$", re.DOTALL | re.IGNORECASE)


def strip_code_fence(code: str) -> str:
    """Removes an optional Markdown fence (```python ... ```) around a code block."""
    match = _FENCE.match(code)
    return match.group(1) if match else code


def extract_code(turn_text: str, tags: Tags = Tags()) -> str | None:
    """Returns the code of the block closed by the first `code_end` in `turn_text`, or `None`.

    A turn of generation stops right after `code_end`, so the block to run is the one that this tag closes: the text
    between the last `code_start` before it and the tag. A `code_end` with no `code_start` before it is not a call.
    The block is read as a notebook cell would be: Windows line endings become `\n`, an optional fence is removed and
    the indentation common to all its lines (a block indented under a list item) is taken off.
    """
    end = turn_text.find(tags.code_end)
    if end < 0:
        return None
    start = turn_text.rfind(tags.code_start, 0, end)
    if start < 0:
        return None
    block = turn_text[start + len(tags.code_start) : end].replace("\r\n", "\n")
    return textwrap.dedent(strip_code_fence(block).strip("\n"))


def format_interpreter_block(output: str, tags: Tags = Tags()) -> str:
    """The text the environment appends after a code call: `interpreter_start` + output + `interpreter_end`."""
    return f"{tags.interpreter_start}{output}{tags.interpreter_end}"


def remove_spans(text: str, start_tag: str, end_tag: str) -> str:
    """Deletes every `start_tag ... end_tag` span (tags included); an unclosed span runs to the end of the text."""
    pieces = []
    pos = 0
    while True:
        start = text.find(start_tag, pos)
        if start < 0:
            pieces.append(text[pos:])
            break
        pieces.append(text[pos:start])
        end = text.find(end_tag, start + len(start_tag))
        if end < 0:
            break
        pos = end + len(end_tag)
    return "".join(pieces)


def model_prose(text: str, tags=Tags()) -> str:
    """The text the model wrote outside code and interpreter blocks.

    This is where a final answer counts: a `\\boxed{}` printed by code (inside an interpreter block) or written in a
    code block is not the model's answer. `tags` is a `Tags`, or a call format (`retool_trl.format.calls`), whose own
    blocks are then the ones left out.
    """
    if hasattr(tags, "model_prose"):
        return tags.model_prose(text)
    spans = ((tags.code_start, tags.code_end), (tags.interpreter_start, tags.interpreter_end))
    return remove_first_spans(text, spans)


def remove_first_spans(text: str, spans) -> str:
    """Deletes every `(start, end)` span, read left to right as written: inside a span, another span's start is just
    text (an interpreter tag in a string literal of code), and a span ends at the first `end` after its start (the
    rollout defangs the tags in the output it splices in, so that one is the real end). An unclosed span runs to the
    end of the text."""
    pieces, pos = [], 0
    while True:
        found = [(text.find(start, pos), start, end) for start, end in spans]
        found = [f for f in found if f[0] >= 0]
        if not found:
            pieces.append(text[pos:])
            return "".join(pieces)
        begin, start, end = min(found, key=lambda f: (f[0], -len(f[1])))
        pieces.append(text[pos:begin])
        close = text.find(end, begin + len(start))
        if close < 0:
            return "".join(pieces)
        pos = close + len(end)


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_output(output: str, tags=Tags()) -> str:
    """Interpreter output made safe to splice into the completion.

    Lone surrogates (from `print(chr(0xD800))`) become U+FFFD, so the text can be encoded; and every tag the output
    contains is defanged with a zero-width space after its first character, so that printed text can neither close
    the interpreter block early (and pass off what follows as the model's prose) nor open a code block.
    """
    output = _LONE_SURROGATE.sub("\ufffd", output)
    for _ in range(len(output) + 1):  # to a fixpoint: a tag such as `]]]` overlaps itself in `]]]]`
        found = [tag for tag in (astuple(tags) if isinstance(tags, Tags) else tags) if tag in output]
        if not found:
            return output
        for tag in found:
            output = output.replace(tag, f"{tag[0]}\u200b{tag[1:]}")
    return output


def last_boxed(text: str) -> str | None:
    """Contents of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, with balanced braces, or `None`."""
    best = None
    for match in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, match.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            best = text[match.end() : i - 1]
    return best


def with_system_prompt(prompts: list, system_prompt: str | None) -> list:
    """Prepends `system_prompt` to every conversational prompt that has no system message; plain-text prompts and
    `None` leave the prompts as they are."""
    if not system_prompt or not prompts or not isinstance(prompts[0], list):
        return prompts
    return [add_system_message(p, system_prompt) for p in prompts]


def first_stop(token_ids: Sequence[int], tokenizer, stop_string: str) -> int | None:
    """Length of the shortest prefix of `token_ids` whose text contains `stop_string`, or `None`.

    Binary search over prefixes (containment only grows with the prefix), so a long turn costs O(log n) decodes.
    """
    if stop_string not in tokenizer.decode(token_ids):
        return None
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if stop_string in tokenizer.decode(token_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo
