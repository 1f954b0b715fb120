"""ReTool-style traces (`<code>...</code><interpreter>...</interpreter>`) rewritten in another call format, for
cold-start SFT in the format RL will use (`retool-trl sft --call_format ...`). Strings only.

- `markdown`: each code block becomes a ```` ```python ```` block closed by ```` ```\\n ```` (where the rollout stops),
  its interpreter block an ```` ```output ```` fence, as the rollout inserts it;
- `tool_call`: the trace becomes assistant messages with `tool_calls` to `code_interpreter`, each answered by a
  `tool` message, then the final assistant message; the chat template renders them (`retool_trl.sft`).
"""

from __future__ import annotations

from .calls import MarkdownFormat
from .parsing import strip_code_fence
from .prompts import Tags

# The markdown format as tags, for the span splitting of SFT traces (the output fence is the environment's span).
MARKDOWN_TAGS = Tags("```python\n", MarkdownFormat.stop, "```output\n", "\n```\n")


def trace_cells(completion: str, tags: Tags = Tags()) -> list[tuple[str, str | None, str | None]]:
    """`(prose, code, output)` for each code block of a trace, in order; the last item holds the closing prose
    (`code` and `output` `None`). A code block without an interpreter block after it gets output `None`; whitespace
    between a code block and its interpreter block is dropped (the rollout inserts the result right after the stop)."""
    cells, pos = [], 0
    while True:
        start = completion.find(tags.code_start, pos)
        end = completion.find(tags.code_end, start + len(tags.code_start)) if start >= 0 else -1
        if end < 0:
            cells.append((completion[pos:], None, None))
            return cells
        prose = completion[pos:start]
        code = strip_code_fence(completion[start + len(tags.code_start) : end].strip("\n")).strip("\n")
        pos = end + len(tags.code_end)
        output = None
        rest = completion[pos:]
        if rest.lstrip().startswith(tags.interpreter_start):
            open_at = pos + len(rest) - len(rest.lstrip()) + len(tags.interpreter_start)
            close = completion.find(tags.interpreter_end, open_at)
            close = len(completion) if close < 0 else close
            output = completion[open_at:close]
            pos = min(len(completion), close + len(tags.interpreter_end))
        cells.append((prose, code, output))


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


def to_tool_messages(completion: str, tags: Tags = Tags(), tool_name: str = "code_interpreter") -> list[dict]:
    """The trace as chat messages: an assistant message per code call (its prose as content, the code as a tool
    call), a `tool` message with the interpreter's output after each, and the closing assistant message."""
    messages = []
    for prose, code, output in trace_cells(completion, tags):
        if code is None:
            messages.append({"role": "assistant", "content": prose.strip()})
            break
        call = {"type": "function", "function": {"name": tool_name, "arguments": {"code": code}}}
        messages.append({"role": "assistant", "content": prose.strip(), "tool_calls": [call]})
        messages.append({"role": "tool", "name": tool_name, "content": output or ""})
    return messages


__all__ = ["MARKDOWN_TAGS", "to_markdown", "to_tool_messages", "trace_cells"]
