"""The event loop behind `LocalSandbox.run_many`: dispatch, CPU-aware admission, replies, deadlines.

A batch works through its sandbox's `BatchHost` interface (below) and each session's process handle
(`SessionProcess`); where a call's result is decided is `results.py`, where a finished call's leftovers are killed is
`sweep.py`.
"""

from __future__ import annotations

import logging
import os
import selectors
import threading
import time
from collections import deque
from typing import Protocol

from .base import ExecResult, refusal
from .channel import SETUP_WAIT_S

logger = logging.getLogger(__name__)

CPU_TICK_S = 0.05  # how often a full pool re-checks whether its running cells actually use a CPU
FIRST_TICK_S = 0.003  # how soon after its start a cell is first checked (a sleeping cell holds its slot so long)
SPIN_S = 0.0006  # how long a lone cell's status is polled (yielding the CPU) before the batch sleeps until it comes
PARK_POLL_S = 0.0002  # how soon a cell whose status came is checked again for being parked...
PARK_POLL_MAX_S = 0.01  # ...doubling up to this while it is not (a forged status ahead of more work)
SETUP_POLL_S = 0.001  # how often a batch with only jails still setting up checks them
ADMIT_WAIT_S = 0.002  # how often a batch waiting for a CPU slot checks, when no cell's end wakes it first
CLOSED_CHECK_S = 0.1  # how often a batch notices that a session was closed under a running cell
DEATH_NOTICE_S = 2.0  # how long a dead process's account of its death may take to come from the zygote


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


class InFlight:
    """The cells running in all batches of one sandbox: several threads may run batches at once (the async rollout
    runs one per completion), and the CPU-aware admission counts them all.

    It also keeps the line of batches waiting for a CPU slot, oldest first: a slot that frees goes to the batch that
    waited longest, whose thread is woken at once, rather than to whichever of dozens of polling threads looks first.
    Without the line, 32 threads each running one cell waited up to 125 ms (p99) for a slot that others, arriving
    later, kept taking; and their polling itself took the CPU the cells needed."""

    def __init__(self):
        self._entries: set = set()
        self._lock = threading.Lock()
        self._line: deque = deque()  # (batch, event) of batches waiting for a slot, oldest first
        # Slots are counted and taken under one lock, and a taken slot counts from then on (`claimed`), before its
        # cell is in `_entries`: otherwise a burst of threads all see the same free slots and all take them.
        self.admitting = threading.Lock()
        self.claimed = 0

    @property
    def count(self) -> int:
        return len(self._entries)

    def add(self, entry) -> None:
        with self._lock:
            self._entries.add(entry)

    def remove(self, entry) -> None:
        with self._lock:
            self._entries.discard(entry)
            self._wake_first()  # a slot may be free: the longest waiter looks first

    def _wake_first(self) -> None:
        """Wakes the batch first in line, if any (called with `_lock` held)."""
        if self._line:
            self._line[0][1].set()

    def snapshot(self) -> list:
        with self._lock:
            return list(self._entries)

    def release_claims(self, count: int) -> None:
        """Slots taken by an admission whose cells are now in flight (or failed to start): no longer claimed."""
        if count:
            with self.admitting:
                self.claimed -= count
            with self._lock:
                self._wake_first()

    def first_in_line(self, batch) -> bool:
        """Whether `batch` may take a slot now: nobody waits, or it waited longest (it joins the line otherwise)."""
        with self._lock:
            if not self._line:
                return True
            if not any(waiting is batch for waiting, _ in self._line):
                self._line.append((batch, threading.Event()))
            return self._line[0][0] is batch

    def wait_in_line(self, batch, timeout_s: float) -> None:
        """Joins the line if not in it, and sleeps until woken (a slot may have freed, or it became first) or, as a
        safety net for a slot freed without a wake-up (a running cell that went to sleep), `timeout_s` passed: the
        first in line checks every `timeout_s`, the others ten times less often."""
        with self._lock:
            event = next((e for waiting, e in self._line if waiting is batch), None)
            if event is None:
                event = threading.Event()
                self._line.append((batch, event))
            first = self._line[0][0] is batch
        event.wait(timeout_s if first else 10 * timeout_s)
        event.clear()

    def leave_line(self, batch) -> None:
        """Leaves the line (it took a slot, or stopped waiting); wakes whoever is first now."""
        with self._lock:
            for item in self._line:
                if item[0] is batch:
                    self._line.remove(item)
                    break
            else:
                return
            self._wake_first()


class _Running:
    """A dispatched cell."""

    __slots__ = (
        "fds",
        "index",
        "session",
        "proc",
        "started",
        "deadline",
        "cpu",
        "cpu_at",
        "busy",
        "reported",
        "dead",
        "spun",
        "poll_s",
    )

    def __init__(self, index, session):
        self.index, self.session, self.proc = index, session, session._proc
        self.reported = False  # its status came: it is over once its process parks
        self.dead = False  # its status pipe closed: the zygote's account of the death is on its way
        self.spun = False  # its status was polled once before the batch first slept
        self.poll_s = PARK_POLL_S
        self.fds: dict[str, int] = {}  # what is registered for it, by kind (the handle may be closed meanwhile)

    def start(self, timeout_s: float) -> None:
        """Starts the cell's clock. It is busy until measured, first FIRST_TICK_S from now, so a cell that only
        sleeps or waits gives its slot away early (its state is "S" and it used no CPU), then every CPU_TICK_S."""
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.cpu, self.cpu_at, self.busy = self.proc.load()[1], self.started - CPU_TICK_S + FIRST_TICK_S, True

    def expect_death(self) -> None:
        """Its status pipe closed: the zygote's account of the death is on its way, and is waited for a short while."""
        self.dead, self.deadline = True, min(self.deadline, time.monotonic() + DEATH_NOTICE_S)


class Batch:
    """One `run_many` call: every session's cells in order, different sessions concurrently.

    Each cell goes straight to its session process (`SessionProcess`): the request down its pipe, its status back on
    another, and the call settles once the process is parked again, never on the status alone.

    Admission: at most `num_workers` cells *computing* at once. A cell that used under 30% of a CPU over the last tick
    (sleeping, waiting on IO) does not count, so a batch of sleepers finishes in one sleep while CPU-bound cells are
    not slowed down (and pushed past their wall-clock limit) by oversubscription. A cell's clock starts once its
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
        self.running: dict[object, _Running] = {}  # by session
        # Sessions whose fresh jail is still setting up: they ask for a CPU slot again once it is set up, so that no
        # slot is held through a set-up (see `_start_cells`); and when each was first seen so.
        self.setting_up: set = set()
        self.setup_since: dict[object, float] = {}
        self.selector = selectors.DefaultSelector()
        self.output_limit = 4 * sandbox.max_output_chars
        self.budget_check_at = time.monotonic() + CPU_TICK_S

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
                    if entry.reported:
                        wait = min(wait, entry.poll_s)
                wait = min(wait, CLOSED_CHECK_S, max(0.0, self.budget_check_at - time.monotonic()))
                # Only a cell alone in the whole sandbox is polled: with others running, the CPU is theirs.
                alone = len(self.running) == 1 and not self.ready and self.sandbox.in_flight.count == 1
                lone = next(iter(self.running.values())) if alone else None
                if lone is not None and not lone.spun:
                    self._spin(lone)
                    if not self.running:
                        continue
                for key, _ in self.selector.select(max(0.0, wait)):
                    kind, entry = key.data
                    if self.running.get(entry.session) is entry:
                        self._handle(kind, entry)
                for entry in [r for r in self.running.values() if r.reported]:
                    self._settle_if_parked(entry, tries=1)
                    entry.poll_s = min(2 * entry.poll_s, PARK_POLL_MAX_S)  # a forged status: back off
                for entry in [r for r in self.running.values() if r.proc.closed]:  # closed by another thread
                    self._finish(entry, lambda session: refusal(True, None))
                now = time.monotonic()
                self._check_cpu_budgets(now)
                for entry in [r for r in self.running.values() if r.deadline <= now]:
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

    def _check_cpu_budgets(self, now: float) -> None:
        """Ends the calls whose jails used more CPU than one call may, all their processes together (the jail's
        cgroup counts every process a cell started, setsid or not; the per-process rlimit counts one). The grace of
        a second lets a lone interpreter's own limit speak first, with its traceback."""
        if now < self.budget_check_at:
            return
        self.budget_check_at = now + CPU_TICK_S
        budget = self.sandbox.cpu_time_s + 1.0
        for entry in list(self.running.values()):
            used = entry.proc.cpu_used()
            if used is not None and used > budget and not entry.dead:
                self._finish(entry, self.sandbox.result_of_cpu_limit, now - entry.started)

    def _spin(self, entry: _Running) -> None:
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

    def _admit(self) -> None:
        self._take_back_set_up()
        if not self.ready:
            if self.setting_up and not self.running:
                time.sleep(SETUP_POLL_S)  # only jails still setting up to wait for
            return
        line = self.sandbox.in_flight
        if not self.running and not line.first_in_line(self):
            line.wait_in_line(self, ADMIT_WAIT_S)  # others waited longer for a slot
            return
        with line.admitting:
            busy = self._count_busy() + line.claimed
            batch, elsewhere = [], []
            while self.ready and busy + len(batch) < self.sandbox.num_workers:
                session = self.ready.popleft()
                if not session._in_use.acquire(blocking=False):
                    elsewhere.append(session)  # running in another thread's batch: try again next round
                    continue
                refusal = self.sandbox.refuse(session)
                if refusal is not None:
                    session._in_use.release()
                    self.results[self.queues[session][0]] = refusal
                    self._advance(session)
                    continue
                batch.append(session)
            line.claimed += len(batch)
        self.ready.extend(elsewhere)
        if batch or self.running:
            line.leave_line(self)
        elif busy >= self.sandbox.num_workers:
            line.wait_in_line(self, ADMIT_WAIT_S)  # every slot taken: wait in line for one
        else:
            line.leave_line(self)  # only sessions busy in other threads' batches: do not hold up the line for them
            time.sleep(ADMIT_WAIT_S)
        try:
            self._start_cells(batch)
        finally:
            line.release_claims(len(batch))

    def _start_cells(self, batch: list) -> None:
        """Gives the admitted sessions that have none a jail (one round trip to the zygote), then sends each its
        cell."""
        fresh = [s for s in batch if s._proc is None]
        errors = dict(zip(fresh, self.sandbox.open_jails(fresh))) if fresh else {}
        for session in batch:
            index = self.queues[session][0]
            if errors.get(session):
                session._in_use.release()
                session._mark_broken("infrastructure error")
                self.results[index] = ExecResult(
                    errors[session], ok=False, timed_out=False, duration_s=0.0, infra_error=True
                )
                self._advance(session)
                continue
            if self._setting_up(session):
                # Its jail was handed out before it finished setting up (a reserve the machine had no CPU for):
                # give the slot back and ask again once it is set up. Held through the set-up, with an engine
                # keeping the CPUs busy, a few such slots made every other thread of an async rollout wait seconds.
                session._in_use.release()
                self.setup_since.setdefault(session, time.monotonic())
                self.setting_up.add(session)
                continue
            waited = self.setup_since.pop(session, None) is not None
            self._dispatch(session, index, setup_wait_s=0.0 if waited else SETUP_WAIT_S)

    def _setting_up(self, session) -> bool:
        """Whether the session's jail is alive but not yet at its wait for requests, and has not been waited for
        past `SETUP_WAIT_S` (then `begin` reports it)."""
        proc = session._proc
        if proc.idle_point is not None or proc.learn_idle_point(timeout_s=0.0) or proc.exited(grace_s=0.0):
            return False
        if proc.setup_problem:  # it cannot be watched (the trainer is out of descriptors): `begin` reports it
            return False
        return time.monotonic() - self.setup_since.get(session, time.monotonic()) < SETUP_WAIT_S

    def _take_back_set_up(self) -> None:
        """Sessions whose jail has finished setting up (or died, closed, or waited too long) ask for a slot again,
        ahead of the others."""
        for session in list(self.setting_up):
            proc = session._proc
            if proc is None or proc.closed or not self._setting_up(session):
                self.setting_up.discard(session)
                self.ready.appendleft(session)

    def _dispatch(self, session, index: int, setup_wait_s: float = SETUP_WAIT_S) -> None:
        entry = _Running(index, session)
        proc = entry.proc
        self.running[session] = entry
        session.calls += 1
        problem = proc.begin({"code": self.pairs[index][1]}, setup_wait_s)
        entry.start(self.sandbox.timeout_s)  # once its request is on the way: a fresh jail may first finish setting up
        self.sandbox.in_flight.add(entry)
        if problem == "not set up":
            crash = {
                "setup_failed": proc.setup_problem
                or f"it did not reach its wait for requests within {SETUP_WAIT_S:g} s"
            }
            self._finish(entry, lambda s: self.sandbox.result_of_crash(s, 0.0, crash=crash))
            return
        if problem:
            if not proc.exited():  # alive, but nobody reads its request pipe: its last cell closed or replaced fd 3
                why = "the previous cell closed the sandbox's request channel (fd 3)"
                self._finish(entry, self.sandbox.result_of_crash, 0.0, why)
                return
            self._on_death(entry)  # it died between calls (killed from outside, say): the zygote says how
            if self.running.get(session) is entry:
                entry.expect_death()
                self._watch(entry, proc.sock.fileno(), selectors.EVENT_READ, "death")
            return
        self._watch(entry, proc.status_r, selectors.EVENT_READ, "status")
        self._watch(entry, proc.sock.fileno(), selectors.EVENT_READ, "death")
        if proc.pending:  # a request larger than the pipe: the rest goes as the process reads
            self._watch(entry, proc.request_w, selectors.EVENT_WRITE, "request")

    def _watch(self, entry: _Running, fd: int, events: int, kind: str) -> None:
        self.selector.register(fd, events, (kind, entry))
        entry.fds[kind] = fd

    def _unwatch(self, entry: _Running, kind: str) -> None:
        fd = entry.fds.pop(kind, None)
        if fd is not None:
            self.selector.unregister(fd)

    def _count_busy(self) -> int:
        """Running cells of the whole sandbox (every thread's batches) that want a CPU. A cell that is not runnable
        now and used little CPU over the last tick (sleeping, waiting on IO) gives its slot away; one starved by a
        loaded machine keeps it (it is runnable)."""
        now = time.monotonic()
        busy = 0
        for entry in self.sandbox.in_flight.snapshot():
            if now - entry.cpu_at >= CPU_TICK_S:
                state, cpu = entry.proc.load()
                if cpu is not None and entry.cpu is not None:
                    entry.busy = state == "R" or (cpu - entry.cpu) > 0.3 * (now - entry.cpu_at)
                entry.cpu, entry.cpu_at = cpu, now
            busy += entry.busy
        return busy

    def _finish(self, entry: _Running, settle, *args) -> None:
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
        self._advance(entry.session)

    # ------------------------------------------------------------------------------------------------- events

    def _handle(self, kind: str, entry: _Running) -> None:
        """One event of one cell; whatever goes wrong settles that cell alone, never the rest of the batch."""
        try:
            getattr(self, f"_on_{kind}")(entry)
        except Exception as exc:  # noqa: BLE001 - data from an untrusted process must not take the batch down
            logger.warning("sandbox: settling a cell failed", exc_info=True)
            if self.running.get(entry.session) is entry:
                why = f"the sandbox could not read this cell's result ({type(exc).__name__})"
                self._finish(entry, self.sandbox.result_of_crash, time.monotonic() - entry.started, why)

    def _on_request(self, entry: _Running) -> None:
        if not entry.proc.flush() or not entry.proc.pending:
            self._unwatch(entry, "request")

    def _on_status(self, entry: _Running) -> None:
        if not entry.proc.read_status():
            if not entry.proc.closed and not entry.proc.exited():  # alive: the cell closed or replaced fd 4
                why = "the cell closed the sandbox's status channel (fd 4)"
                self._finish(entry, self.sandbox.result_of_crash, time.monotonic() - entry.started, why)
                return
            # Every writer of the status pipe is gone: the process died, and the zygote's account is on its way.
            self._unwatch(entry, "status")
            entry.expect_death()
            return
        if entry.proc.status is not None:
            entry.reported = True
            # It parks microseconds after its status: yield the CPU a few times rather than wait a poll tick.
            self._settle_if_parked(entry, tries=20)

    def _settle_if_parked(self, entry: _Running, tries: int) -> None:
        for attempt in range(tries):
            if entry.proc.parked():
                reply = entry.proc.settle(self.output_limit)
                self._finish(entry, self.sandbox.result_of_reply, reply, time.monotonic() - entry.started)
                return
            if attempt + 1 < tries:
                os.sched_yield()

    def _on_death(self, entry: _Running) -> None:
        crash = entry.proc.death_notice()
        if crash is not None:
            reply = dict(entry.proc.read_output(limit=self.output_limit), crash=crash)
            self._finish(entry, self.sandbox.result_of_reply, reply, time.monotonic() - entry.started)
        elif entry.proc.zygote_gone:
            self._finish(entry, self.sandbox.result_of_crash, time.monotonic() - entry.started)
