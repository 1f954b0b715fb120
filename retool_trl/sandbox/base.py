"""What every sandbox backend shares: the result type, the session/sandbox interface and output truncation."""

from __future__ import annotations

import re
import signal
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = [
    "ExecResult",
    "FAILURE_KINDS",
    "Sandbox",
    "Session",
    "truncate_output",
    "cut_output",
    "refusal",
    "check_pairs",
    "failure_kind",
    "failures_by_kind",
]

_SIDES = ("head", "tail", "middle")
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class ExecResult:
    """The outcome of running one code cell.

    Args:
        output (`str`):
            Exactly the text shown to the model between the interpreter tags: stdout and stderr of the cell (and the
            repr of a trailing expression when nothing was printed). When `ok` is False it ends with one line that says
            what happened, e.g. `ZeroDivisionError: division by zero` or `TimeoutError: execution exceeded 5.0 s`.
        ok (`bool`):
            False for an exception, a limit (time, memory, processes, ...), a crash or an infrastructure failure.
        timed_out (`bool`):
            True when the cell ran past its wall-clock (or CPU-time) limit.
        duration_s (`float`):
            Wall-clock seconds the cell took, as seen by the caller.
        infra_error (`bool`, defaults to `False`):
            True only when the sandbox itself failed (worker lost for a reason other than the cell's own limits,
            service unreachable after retries); never for the cell's own exception, timeout or memory limit.
    """

    output: str
    ok: bool
    timed_out: bool
    duration_s: float
    infra_error: bool = False

    def __post_init__(self):
        # Whatever a cell raised or a status carried (a lone surrogate in an exception's message, a service's JSON),
        # the model only ever sees valid UTF-8 text: a lone surrogate becomes U+FFFD, as in the rollout's cleaning.
        try:
            self.output.encode("utf-8")
        except UnicodeEncodeError:
            object.__setattr__(self, "output", _LONE_SURROGATE.sub("\ufffd", self.output))


@runtime_checkable
class Session(Protocol):
    """A stateful interpreter: variables, imports and functions defined by one `run` exist in the next."""

    @property
    def closed(self) -> bool: ...

    @property
    def broken(self) -> bool: ...

    def run(self, code: str) -> ExecResult: ...

    def close(self) -> None: ...


@runtime_checkable
class Sandbox(Protocol):
    """A code-execution backend: hands out sessions and runs a batch of cells concurrently."""

    def session(self) -> Session: ...

    def run_many(self, pairs: Iterable[tuple[Session, str]]) -> list[ExecResult]: ...

    def reserve(self, n: int) -> None:
        """Prepares `n` sessions ahead of demand and returns at once (a no-op where nothing can be prepared)."""

    def close(self) -> None: ...


class SandboxWrapper:
    """A sandbox that wraps another and changes only some of its answers (subclasses override `run_many`):
    sessions, `reserve`, `close` and every other attribute are the wrapped backend's.

    Args:
        sandbox: The wrapped backend (`session()`, `run_many()`, `close()`; `reserve()` where it has one).
    """

    # A wrapper that counts or times the calls through it (the step's metrics); checks of the sandbox's own health
    # go around it, so they are not counted as calls of the step.
    observes_calls = False

    def __init__(self, sandbox):
        self.sandbox = sandbox

    def __getattr__(self, name):
        # Only reached for attributes the wrapper lacks (`num_workers`, ...); not during copying or unpickling,
        # before `sandbox` is set.
        if "sandbox" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["sandbox"], name)

    def session(self):
        return self.sandbox.session()

    def reserve(self, n: int) -> None:
        reserve = getattr(self.sandbox, "reserve", None)
        if callable(reserve):
            reserve(n)

    def run_many(self, pairs):
        return self.sandbox.run_many(pairs)

    def close(self) -> None:
        self.sandbox.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SessionBase:
    """What sessions of every backend share: the closed/broken state and `run` through the sandbox's `run_many`."""

    def __init__(self, sandbox):
        self._sandbox = sandbox
        self._broken: str | None = None  # why, once broken
        self._closed = False
        self.calls = 0

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def run(self, code: str) -> ExecResult:
        """Runs one cell in this session and returns its `ExecResult`."""
        return self._sandbox.run_many([(self, code)])[0]


def _marker(elided: int) -> str:
    return f"\n... [{elided} characters elided] ...\n"


def cut_output(head: str, tail: str, total: int, max_chars: int, side: str = "middle") -> str:
    """Truncates a text known only by its first characters, its last characters and its length.

    The sandbox workers keep a bounded head and tail of what a cell prints (so a cell printing gigabytes costs no
    memory); this turns them into the text the model sees. `head` must hold the text's first
    `min(total, max_chars)` characters and `tail` its last ones (same bound); for a short text both are the text.
    """
    if side not in _SIDES:
        raise ValueError(f"truncation side must be one of {_SIDES}, got {side!r}")
    if total <= max_chars:
        return head if len(head) >= total else head + tail[len(tail) - (total - len(head)) :]
    # The marker's own length depends on the number it reports: size it for the worst case (all elided).
    budget = max(0, max_chars - len(_marker(total)))
    if side == "head":
        keep_head, keep_tail = budget, 0
    elif side == "tail":
        keep_head, keep_tail = 0, budget
    else:
        keep_head = budget // 2
        keep_tail = budget - keep_head
    kept_head = head[:keep_head]
    kept_tail = tail[len(tail) - keep_tail :] if keep_tail else ""
    elided = total - len(kept_head) - len(kept_tail)
    text = kept_head + _marker(elided) + kept_tail
    # A tiny `max_chars` cannot hold the marker: fall back to a plain cut so the bound always holds.
    return text if len(text) <= max_chars else (head[:max_chars] if side != "tail" else tail[len(tail) - max_chars :])


def truncate_output(text: str, max_chars: int, side: str = "middle") -> str:
    """Cuts `text` to at most `max_chars` characters, replacing what was removed by a marker.

    Args:
        text (`str`): The text to shorten.
        max_chars (`int`): Length bound of the result, marker included.
        side (`str`, defaults to `"middle"`):
            `"head"` keeps the beginning, `"tail"` keeps the end, `"middle"` keeps both ends and elides the middle.

    Example:
        >>> truncate_output("a" * 50 + "b" * 50, 60)
        'aaaaaaaaaaaaa\\n... [73 characters elided] ...\\nbbbbbbbbbbbbbb'
    """
    if max_chars < 0:
        raise ValueError(f"max_chars must be >= 0, got {max_chars}")
    return cut_output(text[:max_chars], text[len(text) - max_chars :] if max_chars else "", len(text), max_chars, side)


def refusal(closed: bool, broken_reason: str | None) -> ExecResult | None:
    """The result for a cell that must not run (closed or broken session), the same for every backend."""
    if closed:
        return ExecResult("SessionError: this session is closed", ok=False, timed_out=False, duration_s=0.0)
    if broken_reason is not None:
        return ExecResult(
            f"SessionError: this session was reset after an earlier {broken_reason}; its state is lost "
            "(the session is broken and runs no more code)",
            ok=False,
            timed_out=False,
            duration_s=0.0,
        )
    return None


def check_pairs(pairs: Iterable[tuple[Session, str]]) -> Sequence[tuple[Session, str]]:
    """Materialises `run_many`'s argument and rejects obvious misuse early, with the offending position."""
    pairs = list(pairs)
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], str)):
            raise TypeError(f"run_many expects (session, code: str) pairs; item {i} is {type(pair).__name__}")
    return pairs


_SIGNAL_TEXT = {
    signal.SIGSEGV: "SystemError: the interpreter crashed with a segmentation fault (SIGSEGV)",
    signal.SIGBUS: "SystemError: the interpreter crashed with a bus error (SIGBUS)",
    signal.SIGABRT: "SystemError: the interpreter aborted (SIGABRT)",
    signal.SIGFPE: "SystemError: the interpreter crashed with a floating-point exception (SIGFPE)",
    signal.SIGILL: "SystemError: the interpreter crashed with an illegal instruction (SIGILL)",
}


def signal_death_line(sig: int) -> str:
    """The line that ends the output of a cell whose interpreter died from signal `sig` (both backends say it)."""
    return _SIGNAL_TEXT.get(sig, f"SystemError: the interpreter process died from signal {sig}")


# Why a call failed, in four kinds a user acts on differently: the cell's own error, its own timeout (both the model's
# doing, and scored), waiting for the sandbox (a jail not set up in time, a service that said "come back later" or
# did not answer in time) and the sandbox's own failure (a lost interpreter, a service error); the last two are
# `infra_error`. Told apart by the result alone, so every backend is classified the same way.
FAILURE_KINDS = ("cell_error", "cell_timeout", "sandbox_wait", "sandbox_failure")
_WAITING = re.compile(
    r"within \d[\d.]* s|HTTP (429|503)|ReadTimeout|ConnectTimeout|PoolTimeout|timed out|Retry-After|retries",
    re.IGNORECASE,
)


def failure_kind(result: ExecResult) -> str | None:
    """The kind of a failed call (one of `FAILURE_KINDS`), or `None` when the call succeeded."""
    if result.infra_error:
        return "sandbox_wait" if _WAITING.search(result.output) else "sandbox_failure"
    if result.ok:
        return None
    return "cell_timeout" if result.timed_out else "cell_error"


def failures_by_kind(results: Iterable[ExecResult]) -> dict[str, int]:
    """How many of `results` failed, per kind (every kind present, zeros included)."""
    counts = Counter(failure_kind(result) for result in results)
    return {kind: counts.get(kind, 0) for kind in FAILURE_KINDS}
