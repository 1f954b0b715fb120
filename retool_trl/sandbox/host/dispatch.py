"""Which cells of a `Batch` start, and how: CPU-aware admission (a running cell counts the share of a CPU its jail
uses), jails for sessions that have none, fresh jails still setting up giving their slot back, and each cell's
request sent down its session's pipe. Runs in the trainer; the event loop that settles the started cells is
`batch.py`, the line of batches waiting for a slot is `admission.py`.
"""

from __future__ import annotations

import selectors
import time
from collections import deque

from ..base import ExecResult
from . import channel  # its SETUP_WAIT_S is read at each use: one value for the batch and the channel

CPU_TICK_S = 0.05  # how often a full pool re-checks whether its running cells actually use a CPU
CPU_WINDOW_S = 0.5  # over how long a running cell's CPU use is measured (since its start, while it is younger)
FIRST_TICK_S = 0.003  # how soon after its start a cell is first checked (a sleeping cell holds its slot so long)
PARK_POLL_S = 0.0002  # how soon a cell whose status came is checked again for being parked...
PARK_POLL_MAX_S = 0.01  # ...doubling up to this while it is not (a forged status ahead of more work)
SETUP_POLL_S = 0.001  # how often a batch with only jails still setting up checks them
ADMIT_WAIT_S = 0.002  # how often a batch waiting for a CPU slot checks, when no cell's end wakes it first
DEATH_NOTICE_S = 2.0  # how long a dead process's account of its death may take to come from the zygote


class RunningCell:
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


class Dispatch:
    """The starting half of a `Batch` (its `sandbox`, `ready` sessions, `queues`, `running` cells and the sessions
    `setting_up`): admits cells while CPU slots are free, gives their sessions jails and sends each its cell."""

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
        entry = RunningCell(index, session)
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

    def _count_busy(self) -> float:
        """How many CPUs the running cells of the whole sandbox (every thread's batches) want: each counts the share
        of a CPU it used over the last window (`RunningCell.measure`), or a whole one while runnable. A sleeping or
        waiting cell gives its slot away; one starved by a loaded machine keeps it (it is runnable)."""
        now = time.monotonic()
        busy = 0.0
        for entry in self.sandbox.in_flight.snapshot():
            if now - entry.cpu_at >= CPU_TICK_S:
                entry.measure(now)
            busy += entry.busy
        return busy

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
