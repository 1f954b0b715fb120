"""How a `LocalSandbox` gets jails for its sessions: jails reserved ahead of demand, taken from those the zygote
handed out already, or asked for in one round trip with spares for the next sessions; and a session's jail killed.
Runs in the trainer; the zygote that forks them is started by `local.py` (`zygote.py` holds its host side).
"""

from __future__ import annotations

import logging
import socket
import threading
import weakref

from ..base import SessionBase
from .channel import SessionProcess
from .zygote import UnsafeSandboxError, _Zygote

logger = logging.getLogger(__name__)


def _hint(exc: Exception) -> str:
    """The fix, where a session could not start because the trainer ran out of descriptors."""
    return " (raise the trainer's open-file limit: ulimit -n)" if getattr(exc, "errno", None) in (24, 23) else ""


class JailSupply:
    """The jail-handing half of a `LocalSandbox` (its `_start()`, zygote, `_ready` jails under `_ready_lock`,
    `spares`, `num_workers` and `total_memory_mb`)."""

    def reserve(self, n: int) -> None:
        """Asks for `n` sessions ahead of demand, and returns at once: the zygote (started now if need be) forks up
        to `n` jails in the background, at low priority, while the caller does something else (the model generates
        its first turn), so that those sessions' first calls find a jail ready. Bounded by the sandbox's memory
        (about 16 MB of `total_memory_mb` per reserved jail); jails nobody takes are released after a minute.

        Args:
            n (`int`): Sessions about to be opened (the rollout's batch size).
        """
        if self._closed or n <= 0:
            return
        count = min(int(n), max(self.spares, self.total_memory_mb // 16))

        def ask():
            try:
                self._start().reserve(count)
            except Exception:  # noqa: BLE001 - only a hint: the sessions' first calls fork what they need
                logger.debug("sandbox reserve failed", exc_info=True)

        threading.Thread(target=ask, name="retool-sandbox-reserve", daemon=True).start()

    def open_jails(self, sessions: list[SessionBase]) -> list[str | None]:
        """Forks processes for sessions that have none yet; returns an error text per session (None = fine)."""
        try:
            zygote = self._start()
        except UnsafeSandboxError:
            raise  # a configuration to fix, not a failure to retry
        except Exception as exc:  # noqa: BLE001 - reported per cell as an infrastructure error
            return [f"{type(exc).__name__}: {exc}"] * len(sessions)
        with self._ready_lock:
            # Jails handed out ahead of time (see below) save a round trip to the zygote on a session's first call.
            stale = [proc for owner, proc in self._ready if owner is not zygote]
            self._ready = [(owner, proc) for owner, proc in self._ready if owner is zygote]
            taken = [self._ready.pop(0)[1] for _ in range(min(len(sessions), len(self._ready)))]
            # A round trip is needed anyway: bring the ready jails back to `num_workers` (at least 8 when that many
            # spares are kept) in the same one, so that most first calls need none (1.2 -> 1.0 ms first-call p50).
            keep = max(self.num_workers, min(self.spares, 8))
            extra = max(0, keep - len(self._ready)) if len(taken) < len(sessions) else 0
        for proc in stale:
            proc.close()
        needed = len(sessions) - len(taken)
        fresh = self._handed_out(zygote, needed, extra) if needed else []
        procs = taken + fresh[: len(sessions) - len(taken)]
        with self._ready_lock:
            spare = fresh[len(procs) - len(taken) :]
            self._ready += [(zygote, proc) for proc in spare if isinstance(proc, SessionProcess)]
        errors = []
        for session, proc in zip(sessions, procs):
            if not isinstance(proc, SessionProcess):
                errors.append(proc)
                continue
            session._proc = proc
            session._finalizer = weakref.finalize(session, proc.close)
            with self._ready_lock:
                self._with_process.add(session)
            errors.append(None)
        return errors

    def _handed_out(self, zygote: _Zygote, count: int, extra: int = 0) -> list[SessionProcess | str]:
        """Asks the zygote for `count` jails in one round trip, and for up to `extra` more that it has ready (never
        forked for them: a fork on this path delays the caller): a `SessionProcess` per jail, or the error text."""
        needed = count
        pairs, short = [], None
        try:
            for _ in range(count + extra):
                pairs.append(socket.socketpair())
        except OSError as exc:  # out of descriptors: the calls left without a jail fail alone, nothing leaks
            short = f"SandboxError: could not start a session process: {exc}{_hint(exc)}"
            extra = max(0, len(pairs) - count)
            count = min(count, len(pairs))
        for ours, _ in pairs:  # before the spawn: the hello carrying the session's pid may come at once
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        requests = [{"op": "spawn"}] * count + [{"op": "spawn", "ready_only": True}] * extra
        try:
            replies = zygote.spawn_many([(request, theirs.fileno()) for request, (_, theirs) in zip(requests, pairs)])
        except (OSError, ConnectionError, ValueError) as exc:
            replies = [{"error": f"sandbox zygote failed: {exc}"}] * len(pairs)
        procs: list[SessionProcess | str] = []
        for (ours, theirs), reply in zip(pairs, replies):
            theirs.close()
            try:
                if "pid" not in reply:
                    raise ConnectionError(reply.get("error"))
                procs.append(SessionProcess.from_hello(ours))
            except (OSError, ConnectionError, ValueError) as exc:
                ours.close()
                procs.append(f"SandboxError: could not start a session process: {exc}{_hint(exc)}")
        return procs[:count] + [short] * (needed - count) + procs[count:] if short else procs

    def _kill(self, session: SessionBase) -> None:
        """Kills a session's jail: its process is pid 1 of the jail's pid namespace, so everything in it goes too;
        the zygote reaps it and frees its cgroups."""
        proc = session._proc
        if proc is None:
            return
        proc.hard_kill()
        proc.close()
