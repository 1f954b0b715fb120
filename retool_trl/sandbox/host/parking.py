"""Freezing parked sessions a moment after their call ends, in one background thread of the trainer.

A session stopped with SIGSTOP at the end of its call can be resumed by any signal its cell arranged (a POSIX timer
sending SIGCONT), and then compute between calls; a frozen cgroup cannot run at all. But a cgroup v1 freeze and the
thaw at the next call cost about 0.08 ms each, a third of a short call made right after the last one (a session's
cells run in a row, as the sandbox server's clients and the pool benchmark make them). So `SessionProcess.settle`
freezes a session at once after its first call or one that came long after the last (it waits for generation turns
between calls); a session whose call came within `FREEZE_AFTER_S` of its last one it only stops and hands here, and
this thread freezes it `FREEZE_AFTER_S` later unless its next call has begun by then. What a stopped session can do
inside that window is bounded: at most `FREEZE_AFTER_S` of CPU per call it made (its next call also checks that it
did not compute past a few clock ticks, `SessionProcess.ran_while_parked`), and whatever it forks in the window is
frozen with it and counted against its next call's CPU budget.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

__all__ = ["FREEZE_AFTER_S", "ParkedFreeze", "fatal_signal_pending", "freeze_later"]

FREEZE_AFTER_S = 0.005
_SIGKILL_BIT = 1 << 8  # bit (signal number - 1) of the pending-signal masks in /proc/PID/status


def fatal_signal_pending(pid: int) -> bool:
    """Whether a SIGKILL is pending for the process: one frozen after it was sent would not die until thawed (the
    zygote's memory watch kills a parked session and thaws it; a freeze landing after that thaw would keep it)."""
    try:
        fd = os.open(f"/proc/{pid}/status", os.O_RDONLY | os.O_CLOEXEC)
        try:
            text = os.read(fd, 8192)
        finally:
            os.close(fd)
        for key in (b"\nSigPnd:", b"\nShdPnd:"):
            at = text.index(key) + len(key)
            if int(text[at : text.index(b"\n", at)], 16) & _SIGKILL_BIT:
                return True
    except (OSError, ValueError):
        pass
    return False


class ParkedFreeze:
    """Mixed into `SessionProcess` (which provides `park_lock`, `park_ticket`, `frozen`, `proc_fds`, `host_pid`,
    `closed`, `park_frozen` and `release_files`): the freeze this module's thread makes, and what cancels it."""

    __slots__ = ()

    def freeze_parked(self, ticket: int) -> None:
        """Freezes the parked session's jail (from `settle`, or this module's thread), unless a call, kill or close
        came since it was parked (`ticket` is then stale). A session the zygote is killing (a pending SIGKILL: its
        memory watch kills and thaws a parked session) is left thawed, or it would not die."""
        with self.park_lock:
            if ticket != self.park_ticket or self.closed or self.frozen:
                return
            # A session whose files were released (see `release_files`) gets its freezer's file opened for this
            # write only, not kept.
            self.frozen = self.park_frozen(True, keep=bool(self.proc_fds))
            if self.frozen and fatal_signal_pending(self.host_pid):
                self.frozen = False
                self.park_frozen(False, keep=bool(self.proc_fds))

    def _cancel_freeze(self) -> None:
        with self.park_lock:
            self.park_ticket += 1

    def _thaw(self) -> None:
        with self.park_lock:
            if self.frozen:
                self.frozen = False
                self.park_frozen(False)


class _Parker:
    """The thread and its queue. Every entry waits the same delay, so the queue is in order of when it is due."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque = deque()  # (due, session, ticket)
        self._thread: threading.Thread | None = None

    def add(self, session, ticket: int) -> bool:
        """Queues the freeze; False when the thread cannot be started (out of tasks): the caller freezes now."""
        with self._cond:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="retool-sandbox-parker", daemon=True)
                try:
                    thread.start()
                except RuntimeError:
                    return False
                self._thread = thread
            self._queue.append((time.monotonic() + FREEZE_AFTER_S, session, ticket))
            if len(self._queue) == 1:
                self._cond.notify()
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                wait = self._queue[0][0] - time.monotonic()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                # Everything due within the next millisecond, in one wake-up: the thread competes for the GIL with
                # the trainer's, and a batch's sessions park within a few milliseconds of each other.
                horizon, due = time.monotonic() + 0.001, []
                while self._queue and self._queue[0][0] <= horizon:
                    due.append(self._queue.popleft())
            for _, session, ticket in due:
                try:
                    session.freeze_parked(ticket)
                except Exception:  # noqa: BLE001 - a session closed meanwhile; the thread serves every other one
                    pass

    def after_fork(self) -> None:
        """A forked copy of the trainer (a DataLoader worker) has no thread and none of the parent's sessions."""
        self._cond = threading.Condition()
        self._queue = deque()
        self._thread = None


_PARKER = _Parker()
os.register_at_fork(after_in_child=_PARKER.after_fork)


def freeze_later(session, ticket: int) -> None:
    """Freezes `session` (`session.freeze_parked(ticket)`) once it has been parked `FREEZE_AFTER_S`; the session
    skips it when its ticket moved on (a new call began, or it closed)."""
    if not _PARKER.add(session, ticket):
        session.freeze_parked(ticket)
