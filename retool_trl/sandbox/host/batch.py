"""The event loop behind `LocalSandbox.run_many`: replies, deaths, deadlines, and each call settled once.

A batch works through its sandbox's `BatchHost` interface (below) and each session's process handle
(`SessionProcess`); which cells start and how (CPU-aware admission, jails, dispatch) is `dispatch.py`, where a call's
result is decided is `results.py`, where a finished call's leftovers are killed is `sweep.py`.
"""

from __future__ import annotations

import logging
import os
import selectors
import time
from collections import deque
from typing import Protocol

from ..base import ExecResult, refusal
from .admission import InFlight
from .channel import STATUS_FLOOD
from .dispatch import CPU_TICK_S, DEATH_NOTICE_S, PARK_POLL_MAX_S, Dispatch, RunningCell

logger = logging.getLogger(__name__)

SPIN_S = 0.0006  # how long a lone cell's status is polled (yielding the CPU) before the batch sleeps until it comes
CLOSED_CHECK_S = 0.1  # how often a batch notices that a session was closed under a running cell


class BatchHost(Protocol):
    """What a `Batch` needs from its sandbox (`LocalSandbox` is one): its limits, the cells in flight over all
    threads, jails for sessions that have none, and the results of settled, timed-out, over-budget or dead calls
    (each of which may kill the session's jail and mark the session broken)."""

    num_workers: int
    timeout_s: float
    cpu_time_s: float
    max_output_chars: int
    in_flight: InFlight

    def refuse(self, session) -> ExecResult | None: ...

    def open_jails(self, sessions: list) -> list[str | None]: ...

    def result_of_reply(self, session, reply: dict, duration: float) -> ExecResult: ...

    def result_of_timeout(self, session, duration: float) -> ExecResult: ...

    def result_of_cpu_limit(self, session, duration: float) -> ExecResult: ...

    def result_of_crash(
        self, session, duration: float, why: str | None = None, crash: dict | None = None
    ) -> ExecResult: ...


class CallObserver(Protocol):
    """Told, for each dispatched call, the seconds it waited before it started (for a CPU slot, for its jail), the
    part of that wait its fresh jail took to start (0 for a session that had one), and its latency as its caller saw
    it (wait and execution). Set as the sandbox's `call_observer` (the trainer's stage timings do); `None` by default,
    which costs nothing."""

    def __call__(self, wait_s: float, jail_s: float, latency_s: float) -> None: ...


class Batch(Dispatch):
    """One `run_many` call: every session's cells in order, different sessions concurrently.

    Each cell goes straight to its session process (`SessionProcess`): the request down its pipe, its status back on
    another, and the call settles once the process is parked again, never on the status alone.

    Admission: at most `num_workers` CPUs' worth of cells *computing* at once. Each running cell counts the share of a
    CPU its jail used over the last half second (a whole one while runnable), so a batch of sleepers finishes in one
    sleep, CPU-bound cells are not slowed down (and pushed past their wall-clock limit) by oversubscription, and
    cells that compute in bursts count for what they use. A cell's clock starts once its
    request is on its way.
    """

    def __init__(self, sandbox: BatchHost, pairs):
        self.sandbox = sandbox
        self.pairs = pairs
        self.results: list[ExecResult | None] = [None] * len(pairs)
        self.queues: dict = {}
        for i, (session, _) in enumerate(pairs):
            self.queues.setdefault(session, deque()).append(i)
        self.ready = deque(self.queues)
        self.running: dict[object, RunningCell] = {}  # by session
        # Sessions whose fresh jail is still setting up: they ask for a CPU slot again once it is set up, so that no
        # slot is held through a set-up (see `_start_cells`); and when each was first seen so.
        self.setting_up: set = set()
        self.setup_since: dict[object, float] = {}
        self.selector = selectors.DefaultSelector()
        self.output_limit = 4 * sandbox.max_output_chars
        self.budget_check_at = time.monotonic() + CPU_TICK_S
        # Who is told how long each call waited (see `CallObserver`); when each session's next cell became ready to
        # run, when its fresh jail was asked for, and each dispatched call's wait.
        self.observer: CallObserver | None = getattr(sandbox, "call_observer", None)
        self.ready_at = dict.fromkeys(self.queues, time.monotonic()) if self.observer else {}
        self.jail_asked_at: dict[object, float] = {}
        self.waited: dict[object, tuple[float, float]] = {}

    def run(self) -> list[ExecResult]:
        try:
            while self.ready or self.running or self.setting_up:
                self._admit()
                if not self.running:
                    continue
                wait = min(r.deadline for r in self.running.values()) - time.monotonic()
                if self.ready:
                    wait = min(wait, CPU_TICK_S)
                for entry in self.running.values():
                    if entry.reported or entry.polled:
                        wait = min(wait, entry.poll_s)
                wait = min(wait, CLOSED_CHECK_S, max(0.0, self.budget_check_at - time.monotonic()))
                # Only a cell alone in the whole sandbox is polled: with others running, the CPU is theirs.
                alone = len(self.running) == 1 and not self.ready and self.sandbox.in_flight.count == 1
                lone = next(iter(self.running.values())) if alone else None
                if lone is not None and not lone.spun:
                    self._spin(lone)
                    if not self.running:
                        continue
                events = self.selector.select(max(0.0, wait))
                looked = time.monotonic()  # every cell that ended by now is among `events`
                for key, _ in events:
                    kind, entry = key.data
                    if self.running.get(entry.session) is entry:
                        self._handle(kind, entry)
                for entry in [r for r in self.running.values() if r.polled and not r.dead]:
                    self._on_status(entry)  # what came since the last tick (a frame larger than the pipe, a flood)
                for entry in [r for r in self.running.values() if r.reported]:
                    self._settle_if_parked(entry, tries=1)
                for entry in self.running.values():
                    if entry.reported or entry.polled:
                        entry.poll_s = min(2 * entry.poll_s, PARK_POLL_MAX_S)  # a forged status: back off
                for entry in [r for r in self.running.values() if r.proc.closed]:  # closed by another thread
                    self._finish(entry, lambda session: refusal(True, None))
                now = time.monotonic()
                self._check_cpu_budgets(now)
                for entry in [r for r in self.running.values() if r.deadline <= now]:
                    if entry.deadline > looked and self._ended_unseen(entry):
                        continue  # it ended while this loop was busy settling others: not a timeout
                    if entry.dead:  # the status pipe closed but no account of the death came
                        self._finish(entry, self.sandbox.result_of_crash, now - entry.started)
                    else:
                        self._finish(entry, self.sandbox.result_of_timeout, now - entry.started)
        finally:
            self.sandbox.in_flight.leave_line(self)
            # Only an exception in our own code leaves cells running: do not leave their sessions half-way.
            for entry in list(self.running.values()):
                self._finish(entry, self.sandbox.result_of_crash, 0.0, "the sandbox host failed")
            self.selector.close()
        return self.results  # type: ignore[return-value]

    def _ended_unseen(self, entry: RunningCell) -> bool:
        """Settles a cell whose deadline passed while this loop was busy (another session's cleanup, say) if it is
        parked by now, and says whether it did: its end came after the loop last looked, and whether before or
        after the deadline cannot be told, so it gets its result rather than a timeout its neighbour caused."""
        was_dead = entry.dead
        self._on_status(entry)
        if entry.dead and not was_dead:  # it died meanwhile: the zygote's account of how is on its way
            entry.deadline = time.monotonic() + DEATH_NOTICE_S
            return True
        if self.running.get(entry.session) is entry and entry.reported:
            self._settle_if_parked(entry, tries=1)
        return self.running.get(entry.session) is not entry

    def _spin(self, entry: RunningCell) -> None:
        """Polls a lone cell's status for a short while before sleeping: most cells of a rollout take well under a
        millisecond, and waking a sleeping thread (an idle virtual CPU, above all) costs about as much again."""
        entry.spun = True
        end = time.monotonic() + SPIN_S
        while not entry.reported and not entry.dead and time.monotonic() < end:
            self._on_status(entry)
            os.sched_yield()

    def _advance(self, session) -> None:
        self.queues[session].popleft()
        if self.queues[session]:
            self.ready.append(session)

    def _watch(self, entry: RunningCell, fd: int, events: int, kind: str) -> None:
        self.selector.register(fd, events, (kind, entry))
        entry.fds[kind] = fd

    def _unwatch(self, entry: RunningCell, kind: str) -> None:
        fd = entry.fds.pop(kind, None)
        if fd is not None:
            self.selector.unregister(fd)

    def _finish(self, entry: RunningCell, settle, *args) -> None:
        """Stops watching the cell's channels, then settles it with `settle(session, *args)` (which may kill its
        process, and with it close those channels)."""
        if self.running.pop(entry.session, None) is not None:
            self.sandbox.in_flight.remove(entry)
            for kind in list(entry.fds):
                self._unwatch(entry, kind)
        try:
            self.results[entry.index] = settle(entry.session, *args)
        finally:
            entry.session._in_use.release()
        if self.observer:
            self._observe(entry.session)
        self._advance(entry.session)

    def _observe(self, session) -> None:
        """Tells the observer how long the call that just settled waited before it started, how much of that was
        its fresh jail starting, and how long it took in all as its caller saw it."""
        now = time.monotonic()
        wait_s, jail_s = self.waited.pop(session, (0.0, 0.0))
        latency_s = now - self.ready_at.get(session, now)
        self.ready_at[session] = now  # the session's next cell is ready once this one has settled
        try:
            self.observer(wait_s, jail_s, latency_s)
        except Exception:  # noqa: BLE001 - a timing hook must never settle a call differently
            logger.warning("sandbox: the call observer failed", exc_info=True)

    # ------------------------------------------------------------------------------------------------- events

    def _handle(self, kind: str, entry: RunningCell) -> None:
        """One event of one cell; whatever goes wrong settles that cell alone, never the rest of the batch."""
        try:
            getattr(self, f"_on_{kind}")(entry)
        except Exception as exc:  # noqa: BLE001 - data from an untrusted process must not take the batch down
            logger.warning("sandbox: settling a cell failed", exc_info=True)
            if self.running.get(entry.session) is entry:
                why = f"the sandbox could not read this cell's result ({type(exc).__name__})"
                self._finish(entry, self.sandbox.result_of_crash, time.monotonic() - entry.started, why)

    def _on_request(self, entry: RunningCell) -> None:
        if not entry.proc.flush() or not entry.proc.pending:
            self._unwatch(entry, "request")

    def _on_status(self, entry: RunningCell) -> None:
        if not entry.proc.read_status():
            if not entry.proc.closed and not entry.proc.exited():  # alive: the cell closed or replaced fd 4
                why = "the cell closed the sandbox's status channel (fd 4)"
                self._finish(entry, self.sandbox.result_of_crash, time.monotonic() - entry.started, why)
                return
            # Every writer of the status pipe is gone: the process died, and the zygote's account is on its way.
            self._unwatch(entry, "status")
            entry.expect_death()
            return
        if (entry.proc.status or {}).get("fatal") == STATUS_FLOOD:
            why = "the cell flooded the sandbox's status channel (fd 4)"
            self._finish(entry, self.sandbox.result_of_crash, time.monotonic() - entry.started, why)
            return
        if not entry.polled and entry.proc.status_bytes and "status" in entry.fds:
            # From its first bytes on, the pipe is read at the (backing-off) poll ticks, not on every write: a cell
            # writing frames as fast as it can no longer wakes this loop for each (it cost the trainer 0.3-0.7
            # CPU-seconds per second), and a flood is seen at the next tick.
            entry.polled = True
            self._unwatch(entry, "status")
        if entry.proc.status is not None:
            entry.reported = True
            # It parks microseconds after its status: yield the CPU a few times rather than wait a poll tick.
            self._settle_if_parked(entry, tries=20)

    def _settle_if_parked(self, entry: RunningCell, tries: int) -> None:
        for attempt in range(tries):
            if entry.proc.parked():
                reply = entry.proc.settle(self.output_limit)
                self._finish(entry, self.sandbox.result_of_reply, reply, time.monotonic() - entry.started)
                return
            if attempt + 1 < tries:
                os.sched_yield()

    def _on_death(self, entry: RunningCell) -> None:
        crash = entry.proc.death_notice()
        if crash is not None:
            reply = dict(entry.proc.read_output(limit=self.output_limit), crash=crash)
            self._finish(entry, self.sandbox.result_of_reply, reply, time.monotonic() - entry.started)
        elif entry.proc.zygote_gone:
            self._finish(entry, self.sandbox.result_of_crash, time.monotonic() - entry.started)
