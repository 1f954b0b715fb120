"""What the sandbox server holds: one `LocalSandbox` per limit profile, the live sessions, the bound on running
calls, and the counters `/metrics` shows. Blocking code only (the app runs it in worker threads)."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from ..base import ExecResult
from ..host.local import LocalSandbox, LocalSession
from .config import ServerConfig

__all__ = ["Full", "SessionTable", "UnknownSession"]

logger = logging.getLogger(__name__)


class Full(Exception):
    """The server is at its bound (running calls or live sessions): the caller answers 429 and nothing is queued."""


class UnknownSession(KeyError):
    """No such session here: never created, closed, expired, or created by an earlier run of the server."""


@dataclass(frozen=True)
class Profile:
    """The limits a `LocalSandbox` is built with (one sandbox serves every session with these limits)."""

    timeout_s: float
    memory_mb: int
    max_output_chars: int
    show_last_expression: bool

    def limits(self) -> dict:
        return {"timeout_s": self.timeout_s, "memory_mb": self.memory_mb, "max_output_chars": self.max_output_chars}


@dataclass
class _Live:
    session: LocalSession
    profile: Profile
    lock: threading.Lock = field(default_factory=threading.Lock)  # one call at a time per session
    last_used: float = field(default_factory=time.monotonic)
    busy: int = 0


class SessionTable:
    """The server's state. `call()` bounds the cells running at once (raises `Full` past the bound, never queues);
    `expire()` closes idle sessions; `close()` kills every jail."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self._sandboxes: dict[Profile, LocalSandbox] = {}
        self._sessions: dict[str, _Live] = {}
        self._lock = threading.Lock()
        self.running = 0
        self.counts: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()
        self.closed = False
        self._default = self.profile(config.timeout_s, config.memory_mb, config.max_output_chars, False)

    # --------------------------------------------------------------------------------------------- sandboxes

    def profile(self, timeout_s: float, memory_mb: int, max_output_chars: int, show: bool) -> Profile:
        """The profile serving these (already clamped) limits, starting its sandbox when there is room for one."""
        wanted = Profile(timeout_s, memory_mb, min(int(max_output_chars), self.config.max_output_chars), show)
        with self._lock:
            if wanted in self._sandboxes:
                return wanted
            if len(self._sandboxes) < self.config.max_limit_profiles:
                self._sandboxes[wanted] = self._build(wanted)
                return wanted
            # No room for another sandbox: the nearest served limits that are not below the request's.
            above = [
                p
                for p in self._sandboxes
                if p.show_last_expression == show
                and p.timeout_s >= timeout_s
                and p.memory_mb >= memory_mb
                and p.max_output_chars >= wanted.max_output_chars
            ]
            if above:
                return min(above, key=lambda p: (p.timeout_s, p.memory_mb, p.max_output_chars))
            # None is as large: the largest served (the request asked for more than any has).
            same = [p for p in self._sandboxes if p.show_last_expression == show] or [self._default]
            return max(same, key=lambda p: (p.timeout_s, p.memory_mb, p.max_output_chars))

    def _build(self, profile: Profile) -> LocalSandbox:
        c = self.config
        return LocalSandbox(
            num_workers=c.workers,
            timeout_s=profile.timeout_s,
            memory_mb=profile.memory_mb,
            max_output_chars=profile.max_output_chars,
            show_last_expression=profile.show_last_expression,
            isolation=c.isolation,
            allow_root_without_isolation=c.allow_root_without_isolation,
        )

    def isolation_report(self) -> dict:
        """`LocalSandbox.isolation_report()` of the default profile (starts it: jails are ready before traffic)."""
        return self._sandboxes[self._default].isolation_report()

    # -------------------------------------------------------------------------------------------------- calls

    def acquire(self) -> None:
        """Takes a running-call slot or raises `Full`."""
        with self._lock:
            if self.closed:
                raise Full("the server is shutting down")
            if self.running >= self.config.max_concurrency:
                self.counts["rejected_busy"] += 1
                raise Full(f"{self.running} calls running, the server's bound")
            self.running += 1

    def release(self) -> None:
        with self._lock:
            self.running -= 1

    def run_once(self, code: str, profile: Profile, prelude: str | None = None):
        """One cell in a fresh jail, closed after it (SandboxFusion's stateless `run_code`), after `prelude` (the
        request's files and stdin) in the same jail. Returns `(result, prelude's result or None)`."""
        session = self._sandboxes[profile].session()
        try:
            before = session.run(prelude) if prelude else None
            if before is not None and not before.ok:
                return before, before
            return self._account(session.run(code), "run_code"), before
        finally:
            session.close()

    def open(self, profile: Profile) -> str:
        """A new session (its jail is taken at its first cell); returns its id."""
        with self._lock:
            if self.closed:
                raise Full("the server is shutting down")
            if len(self._sessions) >= self.config.max_sessions:
                self.counts["rejected_sessions"] += 1
                raise Full(f"{len(self._sessions)} live sessions, the server's bound")
            session_id = secrets.token_urlsafe(16)
            self._sessions[session_id] = _Live(self._sandboxes[profile].session(), profile)
            self.counts["sessions_opened"] += 1
            return session_id

    def limits(self, session_id: str) -> dict:
        return self._get(session_id).profile.limits()

    def run(self, session_id: str, cells: list[str]) -> list[ExecResult]:
        """Runs `cells` in order in the session (one call of the session at a time)."""
        live = self._get(session_id)
        with live.lock:
            live.busy += 1
            try:
                return [self._account(live.session.run(code), "session") for code in cells]
            finally:
                live.busy -= 1
                live.last_used = time.monotonic()

    def close_session(self, session_id: str) -> None:
        with self._lock:
            live = self._sessions.pop(session_id, None)
        if live is None:
            raise UnknownSession(session_id)
        live.session.close()
        with self._lock:
            self.counts["sessions_closed"] += 1

    def touch(self, session_id: str) -> None:
        """Marks a session used now (a call refused at the bound still shows its client is there)."""
        with self._lock:
            live = self._sessions.get(session_id)
            if live is not None:
                live.last_used = time.monotonic()

    def _get(self, session_id: str) -> _Live:
        with self._lock:
            live = self._sessions.get(session_id)
        if live is None:
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
        """Closes the sessions idle for longer than `idle_s`; returns how many."""
        now = time.monotonic()
        with self._lock:
            stale = [
                sid
                for sid, live in self._sessions.items()
                if not live.busy and now - live.last_used > self.config.idle_s
            ]
            lives = [self._sessions.pop(sid) for sid in stale]
        for live in lives:
            live.session.close()
        if lives:
            with self._lock:
                self.counts["sessions_expired"] += len(lives)
            logger.info("closed %d session(s) idle for more than %g s", len(lives), self.config.idle_s)
        return len(lives)

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "live_sessions": len(self._sessions),
                "running": self.running,
                "limit_profiles": len(self._sandboxes),
                "counts": dict(self.counts),
                "seconds": dict(self.seconds),
            }

    def close(self) -> None:
        """Refuses new calls and kills every jail (running cells end as the sandbox's infrastructure errors)."""
        with self._lock:
            self.closed = True
            lives, self._sessions = list(self._sessions.values()), {}
            sandboxes = list(self._sandboxes.values())
        for live in lives:
            live.session.close()
        for sandbox in sandboxes:
            sandbox.close()
