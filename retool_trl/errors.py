"""Errors shared by the command line and the library code it drives (a leaf module: imports nothing of the package)."""

from __future__ import annotations


class UserError(ValueError):
    """A mistake in the user's input (a bad option, a missing column, an unusable tokenizer).

    The message names what is wrong and the fix; the command line prints it as one line, without a traceback.
    """


def one_line(error: BaseException) -> str:
    """The message of `error` on a single line (the command line prints every error as one line)."""
    return " ".join(str(error).split()) or type(error).__name__


__all__ = ["UserError", "one_line"]
