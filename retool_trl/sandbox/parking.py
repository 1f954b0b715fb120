"""Freezing parked sessions a moment after their call ends, in one background thread of the trainer.

A session stopped with SIGSTOP at the end of its call can be resumed by any signal its cell arranged (a POSIX timer
sending SIGCONT), and then compute between calls; a frozen cgroup cannot run at all. But a cgroup v1 freeze and the
thaw at the next call cost about 0.08 ms each, which doubled the cost of calls made back to back (a completion's
code blocks often come within a millisecond of each other in a batched rollout, and always in the pool benchmark).
So `SessionProcess.settle` only stops the session and hands it here; this thread freezes it `FREEZE_AFTER_S` later
unless its next call has begun by then. What a stopped session can do inside that window is bounded: at most
`FREEZE_AFTER_S` of CPU per call it made (its next call also checks that it did not compute past a few clock ticks,
`SessionProcess.ran_while_parked`), and whatever it forks in the window is frozen with it and counted against its
next call's CPU budget.
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
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith((b"SigPnd:", b"ShdPnd:")) and int(line.split()[1], 16) & _SIGKILL_BIT:
                    return True
    except (OSError, ValueError, IndexError):
        pass
    return False


class ParkedFreeze:
    """Mixed into `SessionProcess` (which provides `park_lock`, `park_ticket`, `frozen`, `proc_fds`, `host_pid`,
    `closed`, `park_frozen` and `release_files`): the freeze this module's thread makes, and what cancels it."""

    __slots__ = ()

    def freeze_parked(self, ticket: int) -> None:
        """Freezes the parked session's jail (called from parking.py's thread), unless a call, kill or close came
        since it was parked (`ticket` is then stale). A session the zygote is killing (a pending SIGKILL: its
        memory watch kills and thaws a parked session) is left thawed, or it would not die."""
        with self.park_lock:
            if ticket != self.park_ticket or self.closed or self.frozen:
                return
            released = not self.proc_fds  # see `release_files`: the freezer's file is then not kept either
            self.frozen = self.park_frozen(True)
            if self.frozen and fatal_signal_pending(self.host_pid):
                self.frozen = False
                self.park_frozen(False)
            if released:
                self.release_files()

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

    def add(self, session, ticket: int) -> None:
        with self._cond:
            self._queue.append((time.monotonic() + FREEZE_AFTER_S, session, ticket))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="retool-sandbox-parker", daemon=True)
                self._thread.start()
            elif len(self._queue) == 1:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                due = self._queue[0][0]
                now = time.monotonic()
                if due > now:
                    self._cond.wait(due - now)
                    continue
                _, session, ticket = self._queue.popleft()
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
    _PARKER.add(session, ticket)
