"""Limits on what a cell may be and how its failure reads, around any sandbox backend (`ReToolConfig.max_cell_chars`,
`ReToolConfig.interpreter_errors`).

A cell longer than `max_cell_chars` is refused without running (the session's state is unchanged) and answered with
`CellTooLong: over N chars`; with `errors="last_line"` a failing cell is reported by its exception line only
(`NameError: name 'a' is not defined`), which keeps interpreter blocks short for small completion budgets. Both are
ordinary failed cells (`ok=False`), never infrastructure errors, and an infrastructure error passes through untouched.
"""

from __future__ import annotations

from collections.abc import Iterable

from .base import ExecResult, SandboxWrapper

ERROR_FORMATS = ("traceback", "last_line")


def cell_too_long_error(max_chars: int) -> str:
    """The interpreter's reply to a cell over `max_chars` characters."""
    return f"CellTooLong: over {max_chars} chars\n"


class CellLimits(SandboxWrapper):
    """A sandbox that refuses cells over `max_cell_chars` and, with `errors="last_line"`, reports a failing cell by
    its last line. Sessions, `reserve` and everything else are the wrapped backend's.

    Args:
        sandbox: The wrapped backend (`session()`, `run_many()`, `close()`).
        max_cell_chars (`int`, *optional*): Longest cell that runs; `None` for no limit.
        errors (`str`): `"traceback"` (the whole error, as the backend reports it) or `"last_line"`.
    """

    def __init__(self, sandbox, max_cell_chars: int | None = None, errors: str = "traceback"):
        if max_cell_chars is not None and max_cell_chars < 1:
            raise ValueError(f"max_cell_chars must be >= 1 or None, got {max_cell_chars}.")
        if errors not in ERROR_FORMATS:
            raise ValueError(f"errors must be one of {ERROR_FORMATS}, got {errors!r}.")
        super().__init__(sandbox)
        self.max_cell_chars = max_cell_chars
        self.errors = errors

    def run_many(self, pairs: Iterable[tuple[object, str]]) -> list[ExecResult]:
        pairs = list(pairs)
        limit = self.max_cell_chars
        allowed = [k for k, (_, code) in enumerate(pairs) if limit is None or len(code) <= limit]
        ran = iter(self.sandbox.run_many([pairs[k] for k in allowed]) if allowed else [])
        refused = ExecResult(cell_too_long_error(limit or 0), ok=False, timed_out=False, duration_s=0.0)
        allowed_set = set(allowed)
        results = []
        for k in range(len(pairs)):
            result = next(ran) if k in allowed_set else refused
            if k in allowed_set and self.errors == "last_line" and not result.ok and not result.infra_error:
                lines = [line for line in result.output.splitlines() if line.strip()]
                result = ExecResult(
                    f"{lines[-1].strip()}\n" if lines else "",
                    result.ok,
                    result.timed_out,
                    result.duration_s,
                    result.infra_error,
                )
            results.append(result)
        return results


def with_cell_limits(sandbox, args):
    """`sandbox` wrapped in [`CellLimits`] when `args` (a `ReToolConfig`) sets `max_cell_chars` or
    `interpreter_errors="last_line"`; unchanged otherwise, and never wrapped twice."""
    max_cell_chars = getattr(args, "max_cell_chars", None)
    errors = getattr(args, "interpreter_errors", "traceback")
    if max_cell_chars is None and errors == "traceback":
        return sandbox
    if isinstance(sandbox, CellLimits) and (sandbox.max_cell_chars, sandbox.errors) == (max_cell_chars, errors):
        return sandbox
    return CellLimits(sandbox, max_cell_chars, errors)


__all__ = ["CellLimits", "ERROR_FORMATS", "cell_too_long_error", "with_cell_limits"]
