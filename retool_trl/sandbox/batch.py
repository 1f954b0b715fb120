"""The event loop behind `LocalSandbox.run_many`: dispatch, CPU-aware admission, replies, deadlines."""

from __future__ import annotations

import json
import os
import selectors
import socket
import time
from collections import deque

from .base import ExecResult
from .protocol import CREDS, HEADER, frame

CPU_TICK_S = 0.05  # how often a full pool re-checks whether its running cells actually use a CPU
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class _Running:
    """A dispatched cell."""

    __slots__ = ("index", "session", "request_id", "started", "deadline", "cpu", "cpu_at", "busy")

    def __init__(self, index, session, request_id, started, deadline):
        self.index, self.session, self.request_id = index, session, request_id
        self.started, self.deadline = started, deadline
        self.cpu, self.cpu_at, self.busy = None, started, True


class Batch:
    """One `run_many` call: every session's cells in order, different sessions concurrently.

    Admission: at most `num_workers` cells *computing* at once. A cell that used under 30% of a CPU over the last tick
    (sleeping, waiting on IO) does not count, so a batch of sleepers finishes in one sleep while CPU-bound cells are
    not slowed down (and pushed past their wall-clock limit) by oversubscription. A cell's clock starts at dispatch.
    """

    def __init__(self, sandbox, pairs):
        self.sandbox = sandbox
        self.pairs = pairs
        self.results: list[ExecResult | None] = [None] * len(pairs)
        self.queues: dict = {}
        for i, (session, _) in enumerate(pairs):
            self.queues.setdefault(session, deque()).append(i)
        self.ready = deque(self.queues)
        self.running: dict[socket.socket, _Running] = {}
        self.selector = selectors.DefaultSelector()

    def run(self) -> list[ExecResult]:
        try:
            while self.ready or self.running:
                self._admit()
                if not self.running:
                    continue
                wait = min(r.deadline for r in self.running.values()) - time.monotonic()
                if self.ready:
                    wait = min(wait, CPU_TICK_S)
                for key, _ in self.selector.select(max(0.0, wait)):
                    entry = self.running.get(key.fileobj)
                    if entry is not None:
                        self._on_readable(entry)
                now = time.monotonic()
                for entry in [r for r in self.running.values() if r.deadline <= now]:
                    self._finish(entry, self.sandbox._timeout_result, now - entry.started)
        finally:
            # Only an exception in our own code leaves cells running: do not leave their sessions half-way.
            for entry in list(self.running.values()):
                self._finish(entry, self.sandbox._crash_result, 0.0, "the sandbox host failed")
            self.selector.close()
        return self.results  # type: ignore[return-value]

    def _advance(self, session) -> None:
        self.queues[session].popleft()
        if self.queues[session]:
            self.ready.append(session)

    def _admit(self) -> None:
        if not self.ready:
            return
        busy = self._count_busy()
        batch, elsewhere = [], []
        while self.ready and busy + len(batch) < self.sandbox.num_workers:
            session = self.ready.popleft()
            if not session._in_use.acquire(blocking=False):
                elsewhere.append(session)  # running in another thread's batch: try again next round
                continue
            refusal = self.sandbox._refusal(session)
            if refusal is not None:
                session._in_use.release()
                self.results[self.queues[session][0]] = refusal
                self._advance(session)
                continue
            batch.append(session)
        self.ready.extend(elsewhere)
        if elsewhere and not batch and not self.running:
            time.sleep(0.001)  # only cells of other threads to wait for
        fresh = [s for s in batch if s._proc is None]
        errors = dict(zip(fresh, self.sandbox._spawn(fresh))) if fresh else {}
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
            self._dispatch(session, index)

    def _dispatch(self, session, index: int) -> None:
        request_id = next(self.sandbox._request_ids)
        started = time.monotonic()
        proc = session._proc
        try:
            # Requests are small and the session process is idle in recv(): this never waits in practice.
            proc.sock.settimeout(self.sandbox.timeout_s)
            proc.sock.sendall(frame({"id": request_id, "code": self.pairs[index][1]}))
            proc.sock.setblocking(False)
        except OSError:
            self.results[index] = self.sandbox._crash_result(session, 0.0, "the interpreter stopped accepting input")
            session._in_use.release()
            self._advance(session)
            return
        session.calls += 1
        entry = _Running(index, session, request_id, started, started + self.sandbox.timeout_s)
        self.running[proc.sock] = entry
        self.selector.register(proc.sock, selectors.EVENT_READ)

    def _count_busy(self) -> int:
        """Running cells that want a CPU. A cell that is not runnable now and used little CPU over the last tick
        (sleeping, waiting on IO) gives its slot away; one starved by a loaded machine keeps it (it is runnable)."""
        now = time.monotonic()
        busy = 0
        for entry in self.running.values():
            if now - entry.cpu_at >= CPU_TICK_S:
                host_pid = entry.session._proc.host_pid
                state, cpu = _sched_state(host_pid) if host_pid else (None, None)
                if cpu is not None and entry.cpu is not None:
                    entry.busy = state == "R" or (cpu - entry.cpu) > 0.3 * (now - entry.cpu_at)
                entry.cpu, entry.cpu_at = cpu, now
            busy += entry.busy
        return busy

    def _finish(self, entry: _Running, settle, *args) -> None:
        """Stops watching the cell's socket, then settles it with `settle(session, *args)` (which may kill its
        process, and with it close that socket)."""
        sock = entry.session._proc.sock
        if self.running.pop(sock, None) is not None:
            self.selector.unregister(sock)
        try:
            self.results[entry.index] = settle(entry.session, *args)
        finally:
            entry.session._in_use.release()
        self._advance(entry.session)

    def _on_readable(self, entry: _Running) -> None:
        proc = entry.session._proc
        duration = time.monotonic() - entry.started
        try:
            if proc.host_pid is None:
                # The first frame is the hello: its SCM_CREDENTIALS carry the process's pid in *our* namespace.
                data, ancdata, _, _ = proc.sock.recvmsg(1 << 16, socket.CMSG_SPACE(CREDS.size))
                for level, kind, payload in ancdata:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(payload) >= CREDS.size:
                        proc.learn_pid(CREDS.unpack(payload[: CREDS.size])[0])
            else:
                data = proc.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._finish(entry, self.sandbox._crash_result, duration)
            return
        proc.buffer += data
        limit = 16 * self.sandbox.max_output_chars + (1 << 16)
        while len(proc.buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(proc.buffer)
            if size > limit:
                why = "the interpreter sent an oversized reply"
                self._finish(entry, self.sandbox._crash_result, duration, why)
                return
            if len(proc.buffer) < HEADER.size + size:
                return
            payload = bytes(proc.buffer[HEADER.size : HEADER.size + size])
            del proc.buffer[: HEADER.size + size]
            try:
                reply = json.loads(payload)
            except ValueError:
                reply = None
            if isinstance(reply, dict) and reply.get("hello") and reply.get("creds") is False:
                proc.learn_pid(int(reply["pid"]))
            # Only the zygote writes on this socket (cells cannot reach it); a reply for another call settles nothing.
            if isinstance(reply, dict) and reply.get("id") == entry.request_id and not reply.get("hello"):
                self._finish(entry, self.sandbox._reply_result, reply, duration)
                return


def _sched_state(pid: int) -> tuple[str | None, float | None]:
    """A process's scheduler state ("R" = running or runnable) and CPU seconds so far, from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    except (OSError, IndexError, ValueError):
        return None, None
