"""What a cell writes and how its error reads, the same for both backends: one module, two places it runs.

The local backend's session process (`session_process.py`) imports it inside the jail; the remote backend sends its
source inside the program it runs on the code execution service (`remote_driver.py`). So it is standard library only,
runs on Python 3.8, and has no `from __future__` import (its source is spliced into another program).
"""

import os
import traceback
from collections import deque


class Capture:
    """A cell's `sys.stdout` and `sys.stderr`: keeps the first and last `limit` characters and counts the rest."""

    encoding = "utf-8"
    errors = "replace"

    def __init__(self, limit):
        self.limit = limit
        self.head = []
        self.head_len = 0
        self.tail = deque()
        self.tail_len = 0
        self.total = 0
        self.buffer = self  # `sys.stdout.buffer.write(b"...")` works too

    def write(self, text):
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", "replace")
        elif not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        n = len(text)
        if not n:
            return 0
        self.total += n
        if self.head_len < self.limit:
            piece = text[: self.limit - self.head_len]
            self.head.append(piece)
            self.head_len += len(piece)
        self.tail.append(text)
        self.tail_len += n
        while self.tail_len - len(self.tail[0]) >= self.limit:
            self.tail_len -= len(self.tail.popleft())
        return n

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def flush(self):
        pass

    def isatty(self):
        return False

    def fileno(self):
        return 1  # native writers (and subprocesses) land in the descriptor-level capture

    def writable(self):
        return True

    def readable(self):
        return False

    @property
    def closed(self):
        return False

    def texts(self):
        """`(head, tail, total)`: the first and last `limit` characters and how many were written."""
        tail = "".join(self.tail)
        return "".join(self.head), tail[len(tail) - self.limit :] if len(tail) > self.limit else tail, self.total

    def text(self):
        """What the cell wrote when it fits in head and tail (`total` characters), else the head, then the tail; the
        characters between them (`total - len(text)`) are the ones elided."""
        head, tail, total = self.texts()
        overlap = len(head) + len(tail) - total
        return head + tail[overlap:] if overlap > 0 else head + tail


def format_exception(exc, own_files, last_line=None):
    """A short, notebook-like traceback: the cell's frames (and the last library frames), none of `own_files`
    (the runner's own source files); the last line says what happened, `last_line` if given."""
    te = traceback.TracebackException.from_exception(exc)
    own = {os.path.abspath(name) for name in own_files}
    frames = [] if isinstance(exc, SyntaxError) else [f for f in te.stack if os.path.abspath(f.filename) not in own]
    lines = ["Traceback (most recent call last):\n"] + list(traceback.StackSummary.from_list(frames[-5:]).format())
    lines = lines if frames else []
    only = list(te.format_exception_only())
    if last_line is None and isinstance(exc, SyntaxError):
        lines += only  # file/line/caret lines, then "SyntaxError: ..." last
    else:
        # One final line, whatever the message: the model (and the tests) read the last line as "what happened".
        lines.append((last_line or " ".join("".join(only).split())) + "\n")
    return "".join(lines)
