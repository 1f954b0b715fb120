"""Reading a ReTool-style trace (`<code>...</code><interpreter>...</interpreter>`) cell by cell, so each call format
can rewrite it in its own markup for cold-start SFT (`CallFormat.sft_trace`). Strings only."""

from __future__ import annotations

from .parsing import strip_code_fence
from .prompts import Tags


def trace_cells(completion: str, tags: Tags = Tags()) -> list[tuple[str, str | None, str | None]]:
    """`(prose, code, output)` for each code block of a trace, in order; the last item holds the closing prose
    (`code` and `output` `None`). A code block without an interpreter block after it gets output `None`; whitespace
    between a code block and its interpreter block is dropped (the rollout inserts the result right after the stop).

    Each output is taken as the sandbox prints it (`as_printed`): a trace written for people often frames it in blank
    lines (`<interpreter>\n42\n</interpreter>`), which the rollout never inserts, so SFT on them would teach the
    model to read results in a layout it never sees in RL."""
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
            output = as_printed(completion[open_at:close])
            pos = min(len(completion), close + len(tags.interpreter_end))
        cells.append((prose, code, output))


def as_printed(output: str) -> str:
    """A trace's interpreter text as the sandbox would return it: no blank lines around it, and the one final
    newline that `print` writes (empty stays empty)."""
    body = output.strip("\n")
    return f"{body}\n" if body else ""


__all__ = ["as_printed", "trace_cells"]
