"""The event loop behind `LocalSandbox.run_many`: dispatch, CPU-aware admission, replies, deadlines.

A batch works through its sandbox's `BatchHost` interface (below) and each session's process handle
(`SessionProcess`); where a call's result is decided is `results.py`, where a finished call's leftovers are killed is
`sweep.py`.
"""

from __future__ import annotations

import logging
import os
import selectors
import time
from collections import deque
from typing import Protocol

from ..base import ExecResult, refusal
from . import channel  # its SETUP_WAIT_S is read at each use: one value for the batch and the channel
from .admission import InFlight
from .channel import STATUS_FLOOD

logger = logging.getLogger(__name__)

CPU_TICK_S = 0.05  # how often a full pool re-checks whether its running cells actually use a CPU
CPU_WINDOW_S = 0.5  # over how long a running cell's CPU use is measured (since its start, while it is younger)
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


class CallObserver(Protocol):
    """Told, for each dispatched call, the seconds it waited before it started (for a CPU slot, for its jail), the
    part of that wait its fresh jail took to start (0 for a session that had one), and its latency as its caller saw
    it (wait and execution). Set as the sandbox's `call_observer` (the trainer's stage timings do); `None` by default,
    which costs nothing."""

    def __call__(self, wait_s: float, jail_s: float, latency_s: float) -> None: ...


class _Running:
    """A dispatched cell."""

    __slots__ = (
        "fds",
        "index",
        "session",
        "proc",
        "started",
        "deadline",
        "cpu_at",
        "samples",
        "busy",
        "reported",
        "dead",
        "spun",
        "polled",
        "poll_s",
    )

    def __init__(self, index, session):
        self.index, self.session, self.proc = index, session, session._proc
        self.reported = False  # its status came: it is over once its process parks
        self.dead = False  # its status pipe closed: the zygote's account of the death is on its way
        self.spun = False  # its status was polled once before the batch first slept
        self.polled = False  # its status pipe is read at the poll ticks, no longer on every write (see _on_status)
        self.poll_s = PARK_POLL_S
        self.fds: dict[str, int] = {}  # what is registered for it, by kind (the handle may be closed meanwhile)

    def start(self, timeout_s: float) -> None:
        """Starts the cell's clock. It is busy until measured, first FIRST_TICK_S from now, so a cell that only
        sleeps or waits gives its slot away early (its state is "S" and it used no CPU), then every CPU_TICK_S."""
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.cpu_at, self.busy = self.started - CPU_TICK_S + FIRST_TICK_S, 1.0
        self.samples = deque([(self.started, self.proc.load()[1])])  # (when, the jail's CPU seconds then)

    def measure(self, now: float) -> None:
        """How much of a CPU the cell wants: all of one while a process of its jail is runnable, else the share of a
        CPU its jail used over the last CPU_WINDOW_S (since its start, while younger). A share, not a yes/no at an
        instant: cells that compute in bursts between sleeps (a quarter of the time, say) count for what they use."""
        state, cpu = self.proc.load()
        first_at, first = self.samples[0]
        if cpu is not None and first is not None:
            share = (cpu - first) / max(now - first_at, 1e-6)
            # Runnable now (the process, or a child it waits for): a whole CPU. On a busy machine the share a cell
            # gets is less than it wants, and its bursts are then runnable more often: each look counts them.
            runnable = state == "R" or self.proc.others_runnable()
            self.busy = 1.0 if runnable else min(1.0, max(0.0, share))
        self.samples.append((now, cpu))
        while len(self.samples) > 2 and now - self.samples[1][0] >= CPU_WINDOW_S:
            self.samples.popleft()
        self.cpu_at = now

    def expect_death(self) -> None:
        """Its status pipe closed: the zygote's account of the death is on its way, and is waited for a short while."""
        self.dead, self.deadline = True, min(self.deadline, time.monotonic() + DEATH_NOTICE_S)


class Batch:
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
        self.running: dict[object, _Running] = {}  # by session
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

    def _ended_unseen(self, entry: _Running) -> bool:
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
        if self.observer and fresh:
            asked = time.monotonic()
            self.jail_asked_at.update((session, asked) for session in fresh)
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
            self._dispatch(session, index, setup_wait_s=0.0 if waited else channel.SETUP_WAIT_S)

    def _setting_up(self, session) -> bool:
        """Whether the session's jail is alive but not yet at its wait for requests, and has not been waited for
        past `SETUP_WAIT_S` (then `begin` reports it)."""
        proc = session._proc
        if proc.idle_point is not None or proc.learn_idle_point(timeout_s=0.0) or proc.exited(grace_s=0.0):
            return False
        if proc.setup_problem:  # it cannot be watched (the trainer is out of descriptors): `begin` reports it
            return False
        return time.monotonic() - self.setup_since.get(session, time.monotonic()) < channel.SETUP_WAIT_S

    def _take_back_set_up(self) -> None:
        """Sessions whose jail has finished setting up (or died, closed, or waited too long) ask for a slot again,
        ahead of the others."""
        for session in list(self.setting_up):
            proc = session._proc
            if proc is None or proc.closed or not self._setting_up(session):
                self.setting_up.discard(session)
                self.ready.appendleft(session)

    def _dispatch(self, session, index: int, setup_wait_s: float) -> None:
        entry = _Running(index, session)
        proc = entry.proc
        self.running[session] = entry
        session.calls += 1
        problem = proc.begin({"code": self.pairs[index][1]}, setup_wait_s)
        entry.start(self.sandbox.timeout_s)  # once its request is on the way: a fresh jail may first finish setting up
        self.sandbox.in_flight.add(entry)
        if self.observer:
            asked = self.jail_asked_at.pop(session, None)
            jail_s = entry.started - asked if asked is not None else 0.0
            self.waited[session] = (entry.started - self.ready_at.get(session, entry.started), jail_s)
        if problem == "ran while parked":
            why = "the session ran code between calls (a signal the cell arranged resumed it while it was parked)"
            self._finish(entry, self.sandbox.result_of_crash, 0.0, why)
            return
        if problem == "not set up":
            crash = {
                "setup_failed": proc.setup_problem
                or f"it did not reach its wait for requests within {channel.SETUP_WAIT_S:g} s"
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

    def _count_busy(self) -> float:
        """How many CPUs the running cells of the whole sandbox (every thread's batches) want: each counts the share
        of a CPU it used over the last window (`_Running.measure`), or a whole one while runnable. A sleeping or
        waiting cell gives its slot away; one starved by a loaded machine keeps it (it is runnable)."""
        now = time.monotonic()
        busy = 0.0
        for entry in self.sandbox.in_flight.snapshot():
            if now - entry.cpu_at >= CPU_TICK_S:
                entry.measure(now)
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
