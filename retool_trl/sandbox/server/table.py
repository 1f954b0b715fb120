"""What the sandbox server holds: the limit profiles (one `LocalSandbox` each, all sharing the node's CPU slots and
memory budget), the live sessions and whose they are, the bound on running cells, and the counters `/metrics` shows.
Blocking code only (the app runs it in worker threads), except the quick checks `begin`/`end` of a call.

What one client does never changes what another gets: a session is served by the profile of exactly the limits it
asked for (never another's), a profile is built for it or refused (429) when every one is in use, and profiles no live
session uses are given back. A client holds a bounded number of sessions and profiles. Each live session (and each
running `/run_code` call) reserves its `memory_mb` of the memory budget, and one client at most its share of it, or
is refused (429, `MemoryFull`): the memory the sessions may hold never adds up to more than the budget, so sessions
another tenant parks rarely leave a cell short. The sandbox frees memory a little before its whole budget is used
(about 90%), so a cell within its own `memory_mb` may still be killed when nearly every session uses its whole
reservation: that is the server's failure (`infra_error`), never the cell's. A reservation is given back whatever
fails between taking it and giving it back. A tenant's session is its own: another tenant's token finds no such
session."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from ..base import ExecResult
from ..host.admission import InFlight
from ..host.local import LocalSandbox, LocalSession
from ..host.node import node_share_cpus, node_share_memory_mb
from .config import ServerConfig

__all__ = ["Busy", "Full", "MemoryFull", "Profile", "SessionTable", "TooLarge", "UnknownSession"]

logger = logging.getLogger(__name__)


class Full(Exception):
    """The server (or this client's share of it) is at a bound: the caller answers 429 and nothing is queued."""


class MemoryFull(Full):
    """The memory budget (or this client's share of it) is reserved by live sessions: a 429 a trainer may wait on
    (`{"error": "memory_full"}`), since sessions close as their rollouts end."""


class Busy(Exception):
    """The session is running a cell already: the caller answers 409 and nothing is queued."""


class TooLarge(ValueError):
    """A session asks for more memory than the server's whole budget: it could never open (the caller answers 400)."""


class UnknownSession(KeyError):
    """No such session here: never created, closed, expired, or created by an earlier run of the server."""


@dataclass(frozen=True)
class Profile:
    """The limits a `LocalSandbox` is built with (one sandbox serves every session with exactly these limits)."""

    timeout_s: float
    memory_mb: int
    max_output_chars: int
    show_last_expression: bool

    def limits(self) -> dict:
        return {
            "timeout_s": self.timeout_s,
            "memory_mb": self.memory_mb,
            "max_output_chars": self.max_output_chars,
            "show_last_expression": self.show_last_expression,
        }


@dataclass
class _Served:
    sandbox: LocalSandbox
    users: int = 0  # live sessions and running `/run_code` calls on it
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class _Live:
    session: LocalSession
    profile: Profile
    client: str
    lock: threading.Lock = field(default_factory=threading.Lock)  # held while a call of the session runs
    last_used: float = field(default_factory=time.monotonic)
    used: bool = False  # ran a cell: idle sessions that never did expire sooner


class SessionTable:
    """The server's state. `begin()` takes a running-cell slot (raises `Full` past the bound and `Busy` for a session
    already running, never queues); `expire()` closes idle sessions; `close()` kills every jail."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.cpu_slots = max(1, config.workers or node_share_cpus())
        self.memory_budget_mb = config.total_memory_mb or node_share_memory_mb()
        if self.memory_budget_mb < config.memory_mb:
            raise ValueError(
                f"the memory budget ({self.memory_budget_mb} MB, half of what this machine allows) holds no session "
                f"of the default memory_mb ({config.memory_mb} MB): give --total-memory-mb, or a smaller --memory-mb"
            )
        # What one client may reserve of the budget: by default half, so that one client's idle sessions never
        # hold all of it.
        self.memory_per_client_mb = min(
            self.memory_budget_mb, config.max_memory_per_client_mb or max(config.memory_mb, self.memory_budget_mb // 2)
        )
        # Every profile's cells take their CPU slots from one count (`InFlight`): N profiles never compute more
        # than the node's slots together.
        self._in_flight = InFlight()
        self._profiles: dict[Profile, _Served] = {}
        self._sessions: dict[str, _Live] = {}
        self._held: Counter[tuple[str, Profile]] = Counter()  # (client, profile) -> its sessions and calls on it
        self.reserved_mb = 0  # the `memory_mb` of every live session and running `/run_code` call
        self._reserved_by: Counter[str] = Counter()  # client -> what its sessions and calls reserve
        self._lock = threading.Lock()
        self.running = 0
        self.counts: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()
        self.closed = False
        self._default = Profile(config.timeout_s, config.memory_mb, config.max_output_chars, False)
        self._profiles[self._default] = _Served(self._build(self._default), users=1)  # never given back

    # --------------------------------------------------------------------------------------------- profiles

    def _build(self, profile: Profile) -> LocalSandbox:
        c = self.config
        sandbox = LocalSandbox(
            num_workers=self.cpu_slots,
            timeout_s=profile.timeout_s,
            memory_mb=profile.memory_mb,
            max_output_chars=profile.max_output_chars,
            show_last_expression=profile.show_last_expression,
            isolation=c.isolation,
            allow_root_without_isolation=c.allow_root_without_isolation,
            # Any profile may hold the whole budget: what all of them hold together is bounded by the reservations
            # (each session by its own `memory_mb`), not by a fixed split that one profile's sessions could fill.
            total_memory_mb=self.memory_budget_mb,
        )
        sandbox.in_flight = self._in_flight
        # With every session's memory reserved, a session killed because the sandbox's memory was full stayed
        # within its own bound: the server's failure, retried, never scored as the model's error.
        sandbox.memory_reserved = True
        return sandbox

    def take_profile(self, limits: dict, client: str) -> Profile:
        """The profile of exactly `limits` for `client` (built when there is room, giving back one nobody uses).

        Raises:
            `Full`: every profile is in use, or this client holds its share of them.
        """
        wanted = Profile(
            float(limits["timeout_s"]),
            int(limits["memory_mb"]),
            int(limits["max_output_chars"]),
            bool(limits["show_last_expression"]),
        )
        evicted = None
        with self._lock:
            if self.closed:
                raise Full("the server is shutting down")
            if wanted not in self._profiles or (client, wanted) not in self._held:
                mine = {p for (c, p) in self._held if c == client and p != self._default}
                if wanted != self._default and len(mine) >= self.config.max_profiles_per_client:
                    self.counts["rejected_profiles"] += 1
                    raise Full(
                        f"this client already uses {len(mine)} limit sets (the server's bound per client): close "
                        "sessions of another limit set first, or ask for limits it already uses"
                    )
            if wanted not in self._profiles:
                if len(self._profiles) >= self.config.max_limit_profiles:
                    unused = [(s.last_used, p) for p, s in self._profiles.items() if not s.users]
                    if not unused:
                        self.counts["rejected_profiles"] += 1
                        raise Full(
                            f"all {len(self._profiles)} limit sets this server serves at once are in use by live "
                            "sessions; retry later, or ask for limits one of them has"
                        )
                    evicted_key = min(unused, key=lambda u: u[0])[1]
                    evicted = self._profiles.pop(evicted_key).sandbox
                self._profiles[wanted] = _Served(self._build(wanted))
                self.counts["profiles_built"] += 1
            self._profiles[wanted].users += 1
            self._held[(client, wanted)] += 1
        if evicted is not None:
            evicted.close()
        return wanted

    def drop_profile(self, profile: Profile, client: str) -> None:
        """One user of `profile` fewer (a session closed, or a `/run_code` call done)."""
        with self._lock:
            served = self._profiles.get(profile)
            if served is not None:
                served.users -= 1
                served.last_used = time.monotonic()
            self._held[(client, profile)] -= 1
            if self._held[(client, profile)] <= 0:
                del self._held[(client, profile)]

    def isolation_report(self) -> dict:
        """`LocalSandbox.isolation_report()` of the default profile (starts it: jails are ready before traffic)."""
        return self._profiles[self._default].sandbox.isolation_report()

    # -------------------------------------------------------------------------------------------------- calls

    def acquire(self) -> None:
        """Takes a running-cell slot or raises `Full`."""
        with self._lock:
            if self.closed:
                raise Full("the server is shutting down")
            if self.running >= self.config.max_concurrency:
                self.counts["rejected_busy"] += 1
                raise Full(f"{self.running} cells running, the server's bound")
            self.running += 1

    def release(self) -> None:
        with self._lock:
            self.running -= 1

    def reserve(self, memory_mb: int, client: str) -> None:
        """Reserves `memory_mb` of the budget for `client` (a `/run_code` call's) or raises `MemoryFull`
        (`TooLarge` if it never fits)."""
        with self._lock:
            self._reserve(memory_mb, client)

    def unreserve(self, memory_mb: int, client: str) -> None:
        with self._lock:
            self._unreserve(memory_mb, client)

    def _unreserve(self, memory_mb: int, client: str) -> None:
        # Called with `_lock` held.
        self.reserved_mb -= memory_mb
        self._reserved_by[client] -= memory_mb
        if self._reserved_by[client] <= 0:
            del self._reserved_by[client]

    def _reserve(self, memory_mb: int, client: str) -> None:
        # Called with `_lock` held.
        if memory_mb > self.memory_budget_mb:
            raise TooLarge(
                f"memory_mb must be at most {self.memory_budget_mb} on this server (its whole memory budget), got "
                f"{memory_mb}"
            )
        if memory_mb > self.memory_per_client_mb:
            raise TooLarge(
                f"memory_mb must be at most {self.memory_per_client_mb} on this server (what one client may hold, "
                f"--max-memory-per-client-mb), got {memory_mb}"
            )
        if self.reserved_mb + memory_mb > self.memory_budget_mb:
            self.counts["rejected_memory"] += 1
            raise MemoryFull(
                f"live sessions reserve {self.reserved_mb} MB of this server's {self.memory_budget_mb} MB memory "
                f"budget and this one needs {memory_mb} MB: retry later, close sessions, or ask for less memory_mb"
            )
        mine = self._reserved_by[client]  # a Counter: reading a missing client stores nothing
        if mine + memory_mb > self.memory_per_client_mb:
            self.counts["rejected_client_memory"] += 1
            raise MemoryFull(
                f"this client's sessions reserve {mine} MB and this one needs {memory_mb} MB, past the "
                f"{self.memory_per_client_mb} MB one client may hold (--max-memory-per-client-mb): close sessions, "
                "or ask for less memory_mb"
            )
        self.reserved_mb += memory_mb
        self._reserved_by[client] += memory_mb

    def run_once(self, code: str, profile: Profile, prelude: str | None = None):
        """One cell in a fresh jail, closed after it (SandboxFusion's stateless `run_code`), after `prelude` (the
        request's files and stdin) in the same jail. Returns `(result, prelude's result or None)`."""
        with self._lock:
            sandbox = self._profiles[profile].sandbox  # held by the caller's `take_profile`: not given back
        session = sandbox.session()
        try:
            before = session.run(prelude) if prelude else None
            if before is not None and not before.ok:
                return before, before
            return self._account(session.run(code), "run_code"), before
        finally:
            session.close()

    def open(self, limits: dict, client: str) -> tuple[str, Profile]:
        """A new session of exactly `limits` for `client` (its jail is taken at its first cell): `(id, profile)`.

        Raises:
            `Full`: a bound on sessions, limit sets or memory is reached. `TooLarge`: its memory never fits here.
        """
        memory_mb = int(limits["memory_mb"])
        with self._lock:
            if self.closed:
                raise Full("the server is shutting down")
            if len(self._sessions) >= self.config.max_sessions:
                self.counts["rejected_sessions"] += 1
                raise Full(f"{len(self._sessions)} live sessions, the server's bound")
            mine = sum(1 for live in self._sessions.values() if live.client == client)
            if mine >= self.config.max_sessions_per_client:
                self.counts["rejected_sessions"] += 1
                raise Full(f"this client holds {mine} live sessions, the server's bound per client: close some")
            # Reserved now, before the profile is taken, so that opens racing each other never overbook the budget.
            self._reserve(memory_mb, client)
        # Whatever fails from here on (not only a bound: a sandbox that cannot be built), the reservation and the
        # profile taken are given back: nothing leaks.
        profile = None
        session_id = None
        try:
            profile = self.take_profile(limits, client)
            with self._lock:
                # Checked again with the session in: opens of one client racing each other stay within its bound.
                mine = sum(1 for live in self._sessions.values() if live.client == client)
                if mine >= self.config.max_sessions_per_client or len(self._sessions) >= self.config.max_sessions:
                    raise Full("the live-session bound was reached meanwhile")
                sandbox = self._profiles[profile].sandbox
                new_id = secrets.token_urlsafe(16)
                self._sessions[new_id] = _Live(sandbox.session(), profile, client)
                self.counts["sessions_opened"] += 1
                session_id = new_id
        finally:
            if session_id is None:
                if profile is not None:
                    self.drop_profile(profile, client)
                self.unreserve(memory_mb, client)
        return session_id, profile

    def begin(self, session_id: str, client: str | None = None) -> _Live:
        """Starts a call of `client`'s session: its lock and a running slot, or `Busy`/`Full`/`UnknownSession` at
        once (a session of another tenant is unknown to this one)."""
        live = self._get(session_id, client)
        if not live.lock.acquire(blocking=False):
            with self._lock:
                self.counts["rejected_session_busy"] += 1
            raise Busy("this session is running a cell: send its next one once that one is answered")
        try:
            self.acquire()
        except Full:
            live.lock.release()
            raise
        return live

    def end(self, live: _Live) -> None:
        live.last_used = time.monotonic()
        self.release()
        live.lock.release()

    def run(self, live: _Live, cells: list[str]) -> list[ExecResult]:
        """Runs `cells` in order in the session (begun with `begin`)."""
        live.used = True
        return [self._account(live.session.run(code), "session") for code in cells]

    def close_session(self, session_id: str, client: str | None = None) -> None:
        """Closes `client`'s session (a session of another tenant is unknown to this one)."""
        with self._lock:
            live = self._sessions.get(session_id)
            if live is None or not _owned(live, client):
                raise UnknownSession(session_id)
            del self._sessions[session_id]
        self._give_back(live)
        with self._lock:
            self.counts["sessions_closed"] += 1

    def _give_back(self, live: _Live) -> None:
        """Closes a session taken out of the table, then gives back its profile and its reservation, even when
        closing it fails."""
        try:
            live.session.close()  # its memory is freed before its reservation is given back
        finally:
            self.drop_profile(live.profile, live.client)
            self.unreserve(live.profile.memory_mb, live.client)

    def touch(self, session_id: str, client: str | None = None) -> None:
        """Marks a session used now (a call refused at the bound still shows its client is there)."""
        with self._lock:
            live = self._sessions.get(session_id)
            if live is not None and _owned(live, client):
                live.last_used = time.monotonic()

    def _get(self, session_id: str, client: str | None = None) -> _Live:
        with self._lock:
            live = self._sessions.get(session_id)
        if live is None or not _owned(live, client):
            raise UnknownSession(session_id)
        live.last_used = time.monotonic()
        return live

    def _account(self, result: ExecResult, kind: str) -> ExecResult:
        outcome = (
            "infra_error" if result.infra_error else "timeout" if result.timed_out else "ok" if result.ok else "error"
        )
        with self._lock:
            self.counts[f"cells_{kind}_{outcome}"] += 1
            self.seconds[kind] += result.duration_s
        return result

    # ------------------------------------------------------------------------------------------------- upkeep

    def expire(self) -> int:
        """Closes the sessions idle for longer than `idle_s` (`fresh_idle_s` for those that never ran a cell);
        returns how many."""
        now = time.monotonic()
        c = self.config
        with self._lock:
            stale = [
                sid
                for sid, live in self._sessions.items()
                if not live.lock.locked() and now - live.last_used > (c.idle_s if live.used else c.fresh_idle_s)
            ]
            lives = [self._sessions.pop(sid) for sid in stale]
        failed = 0
        for live in lives:  # each one's reservation given back with it: one that fails to close leaks nothing
            try:
                self._give_back(live)
            except Exception:
                failed += 1
                logger.exception("closing an idle session failed (its reservation is given back)")
        if lives:
            with self._lock:
                self.counts["sessions_expired"] += len(lives)
            logger.info("closed %d idle session(s)", len(lives) - failed)
        return len(lives)

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "live_sessions": len(self._sessions),
                "running": self.running,
                "limit_profiles": len(self._profiles),
                "reserved_memory_mb": self.reserved_mb,
                "memory_budget_mb": self.memory_budget_mb,
                "counts": dict(self.counts),
                "seconds": dict(self.seconds),
            }

    def close(self) -> None:
        """Refuses new calls and kills every jail (running cells end as the sandbox's infrastructure errors)."""
        with self._lock:
            self.closed = True
            lives, self._sessions = list(self._sessions.values()), {}
            sandboxes = [served.sandbox for served in self._profiles.values()]
        for live in lives:
            live.session.close()
        for sandbox in sandboxes:
            sandbox.close()


def _owned(live: _Live, client: str | None) -> bool:
    """Whether `client` may use the session: a tenant's session is its own alone (another tenant's token is no
    key to it); without per-tenant tokens the session's unguessable id is the key (`client` None: any caller)."""
    if client is None:
        return True
    return live.client == client or not (live.client.startswith("tenant:") or client.startswith("tenant:"))
