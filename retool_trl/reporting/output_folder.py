"""The output folder of a command, checked before any work starts: a read-only mount or another user's folder ends
the command at once with one line naming the folder and the fix, not with a traceback after hours of work.

`fallback_folder` is where results go when the output folder stops taking writes after the work (a disk filled, a
mount went read-only): a finished evaluation is written there rather than lost.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from ..errors import UserError


def check_output_dir(path: str | Path, option: str = "output_dir") -> Path:
    """Creates `path` if needed and writes (then removes) a probe file in it.

    Raises:
        `UserError`: naming the folder, why it cannot be written, and the fix.
    """
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".retool-write-check-"):
            pass
    except OSError as error:
        why = error.strerror or type(error).__name__
        raise UserError(
            f"{option} {str(folder)!r} cannot be written ({why}); give a folder you can write to (--{option} DIR) or "
            "make this one writable."
        ) from None
    return folder


def fallback_folder(name: str) -> Path:
    """A new folder, in the user's temp directory, for results that could not be written where they were asked."""
    return Path(tempfile.mkdtemp(prefix=f"retool-{name}-{time.strftime('%Y%m%d-%H%M%S')}-", dir=_writable_temp()))


def _writable_temp() -> str:
    for candidate in (tempfile.gettempdir(), os.getcwd(), os.path.expanduser("~")):
        if os.access(candidate, os.W_OK | os.X_OK):
            return candidate
    return tempfile.gettempdir()


__all__ = ["check_output_dir", "fallback_folder"]
