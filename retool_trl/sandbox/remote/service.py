"""The client side of the sandbox server's sessions, used by `RemoteSandbox` (httpx only, no server dependency).

A session lives on one server for its life; its cells run there in its jail, so nothing is replayed. What can go
wrong and what the cell then gets:

- the server's memory budget is reserved by live sessions (a 429 marked `memory_full`, at the session's open):
  waited on, as sessions close when their rollouts end, up to `RemoteSandbox(memory_wait_s=...)` (default
  `DEFAULT_MEMORY_WAIT_S`), not counted against the retries; past it the cell is an `infra_error` naming the fix;
- the server is busy (429), the session is still running an earlier cell (409: the server ran nothing), or it
  cannot be reached before the request is sent: retried with backoff, as for SandboxFusion;
- the server refuses the limits asked (400) or confirms others than asked: a `RuntimeError` naming the limit (a
  setting to fix, not a failure to retry);
- the connection breaks after the cell was sent, the server answers 5xx, or it no longer knows the session (it
  restarted, or the session expired): the cell may or may not have run and the session's state is gone, so the
  session ends with an `infra_error` result (the rollout retries that completion), never a snippet error;
- the answer is late (the server is busy: its cells wait for a worker before their own time limit starts): the
  cell is waited for as long as the server answers its `/health` (asked every `timeout_s + 30` s), since giving up
  would lose the session's state and move the server's load onto the others; a server that stops answering ends
  the wait, and the session, at the next check. `request_timeout_s`, when set, bounds the wait instead.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

from ..base import ExecResult

__all__ = [
    "DEFAULT_MEMORY_WAIT_S",
    "SESSIONS_PATH",
    "MemoryFull",
    "ServiceFailure",
    "close_remote",
    "offers_sessions",
    "run_remote",
]

logger = logging.getLogger(__name__)

SESSIONS_PATH = "/sessions"
_PROBE_TIMEOUT_S = 10.0
# Past a cell's own time limit, how long to wait for its answer before asking whether the server is still there.
_REPLY_MARGIN_S = 30.0
# The longest a request thread waits for a server that answers its health checks but never the cell.
_LONGEST_WAIT_S = 3600.0
# How long a session's open waits for the server's memory budget to have room (live sessions close as their rollouts
# end): long enough for other rollouts of a batch to finish, short enough that a server far too small is reported.
DEFAULT_MEMORY_WAIT_S = 600.0
# Between two asks while waiting for memory (at least what the server's `Retry-After` asks).
_MEMORY_POLL_S = 2.0


class ServiceFailure(Exception):
    """The service failed (after retries where retrying made sense): an infrastructure error, not the cell's.
    `unreachable`: the server could not be reached or dropped the connection (it may be gone)."""

    def __init__(self, problem: str, unreachable: bool = False, status: int | None = None):
        super().__init__(problem)
        self.unreachable = unreachable
        self.status = status  # the HTTP status the server answered with, if it answered


class MemoryFull(ServiceFailure):
    """Our server's memory budget (or this client's share) is reserved by live sessions (a 429 marked
    `memory_full`): waited on at a session's open, not counted against the retries."""

    def __init__(self, problem: str, retry_after: float | None = None):
        super().__init__(problem, status=429)
        self.retry_after = retry_after


def offers_sessions(client, url: str, headers: dict | None = None) -> bool | None:
    """Whether the server at `url` offers our sessions (`GET /health` says `"sessions": 1` or more); `False` for a
    plain SandboxFusion server, `None` when it cannot be reached now (ask again later)."""
    import httpx

    try:
        reply = client.get(f"{url}/health", timeout=_PROBE_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    if reply.status_code == 503:  # ours, draining or starting: ask again later
        return None
    try:
        body = reply.json()
    except ValueError:
        return False
    return reply.status_code == 200 and isinstance(body, dict) and int(body.get("sessions") or 0) >= 1


def run_remote(sandbox, session, code: str) -> ExecResult:
    """One cell of `session` in its jail on its server (creating the session there at its first cell)."""
    start = time.monotonic()
    try:
        if session._remote_id is None:
            limits = {
                "timeout_s": sandbox.timeout_s,
                "memory_mb": sandbox.memory_mb,
                "max_output_chars": sandbox.max_output_chars,
                "show_last_expression": sandbox.show_last_expression,
            }
            try:
                opened = _open_waiting_for_memory(sandbox, session.server, limits)
            except ServiceFailure as exc:
                if exc.status == 400:  # the server cannot give these limits: no retry will change that
                    raise RuntimeError(
                        f"the sandbox server {session.server} refused this trainer's limits ({exc}); set the "
                        "sandbox limits within the server's ranges, or start it with larger maxima"
                    ) from None
                raise
            session._remote_id = str(opened["session_id"])
            _check_confirmed(sandbox, session, limits, opened.get("limits"))
        path = f"{SESSIONS_PATH}/{session._remote_id}/run"
        # Not retried once sent: the cell may have run, and running it twice would change the session's state.
        if sandbox.request_timeout_s:
            reply = sandbox._request("POST", session.server, path, {"code": code}, sandbox.request_timeout_s, False)
        else:
            reply = _wait_while_alive(sandbox, session.server, path, {"code": code})
        result = ExecResult(**reply["results"][0])
    except (ServiceFailure, KeyError, IndexError, TypeError, ValueError) as exc:
        session._broken = "infrastructure error"
        line = f"SandboxError: the sandbox server {session.server} failed: {exc}; the session state is lost"
        return ExecResult(line, ok=False, timed_out=False, duration_s=time.monotonic() - start, infra_error=True)
    if result.infra_error:
        session._broken = "infrastructure error"
    return result


def _open_waiting_for_memory(sandbox, server: str, limits: dict) -> dict:
    """Opens a session on `server`, waiting while its memory budget is reserved by live sessions (up to
    `sandbox.memory_wait_s`).

    Raises:
        `ServiceFailure`: the server failed, or its memory stayed full past the wait (one line naming the fix).
    """
    deadline = time.monotonic() + sandbox.memory_wait_s
    while True:
        try:
            return sandbox._request("POST", server, SESSIONS_PATH, limits, _PROBE_TIMEOUT_S + 20, True, True)
        except MemoryFull as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServiceFailure(
                    f"no room for a {sandbox.memory_mb} MB session in {sandbox.memory_wait_s:g} s: the server's "
                    f"memory budget stays reserved by live sessions ({exc}); start the server with a larger "
                    "--total-memory-mb (or --max-memory-per-client-mb), or ask for a smaller memory_mb",
                    status=429,
                ) from None
            sandbox._pause(min(max(exc.retry_after or 0.0, _MEMORY_POLL_S), left))


def _wait_while_alive(sandbox, server: str, path: str, body: dict) -> dict:
    """POSTs `body` and waits for the answer as long as the server answers its `/health` (see the module
    docstring); raises `ServiceFailure` (unreachable) once it does not."""
    import httpx

    answer: concurrent.futures.Future = concurrent.futures.Future()
    timeout = httpx.Timeout(_LONGEST_WAIT_S, connect=_PROBE_TIMEOUT_S)

    def send() -> None:
        try:
            answer.set_result(sandbox._request("POST", server, path, body, timeout, False))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            answer.set_exception(exc)

    threading.Thread(target=send, name="retool-remote-cell", daemon=True).start()
    while True:
        try:
            return answer.result(timeout=sandbox.timeout_s + _REPLY_MARGIN_S)
        except concurrent.futures.TimeoutError:
            if not _alive(sandbox, server):
                sandbox._mark_down(server)
                raise ServiceFailure(
                    f"no answer {sandbox.timeout_s + _REPLY_MARGIN_S:g} s into the cell, and {server}/health does not "
                    "answer",
                    unreachable=True,
                ) from None


def _alive(sandbox, server: str) -> bool:
    """Whether the server answers `GET /health` (busy or draining included: it still answers its running calls)."""
    import httpx

    try:
        reply = sandbox._start()[0].get(f"{server}/health", timeout=_PROBE_TIMEOUT_S)
    except httpx.HTTPError:
        return False
    return reply.status_code < 500 or reply.status_code == 503


def close_remote(sandbox, server: str, remote_id: str) -> None:
    """Closes a session on its server (best effort: the server also closes it after its idle time)."""
    try:
        sandbox._request("DELETE", server, f"{SESSIONS_PATH}/{remote_id}", None, _PROBE_TIMEOUT_S, False)
    except ServiceFailure as exc:
        logger.debug("closing session %s on %s: %s", remote_id, server, exc)


def _check_confirmed(sandbox, session, asked: dict, confirmed) -> None:
    """A session runs with exactly the limits it asked for: one the server confirms with other limits (lower ones
    would cut right answers or time them out and score them as the model's errors) is closed and refused.

    Raises:
        `RuntimeError`: naming the first limit that differs, what was asked and what the server confirmed.
    """
    confirmed = confirmed if isinstance(confirmed, dict) else {}
    for name, want in asked.items():
        got = confirmed.get(name)
        if isinstance(want, bool) and name not in confirmed:
            continue  # servers before this check did not confirm the flag (they served it as asked)
        same = got == want if isinstance(want, bool) else isinstance(got, int | float) and float(got) == float(want)
        if not same:
            remote_id, session._remote_id = session._remote_id, None
            close_remote(sandbox, session.server, remote_id)
            raise RuntimeError(
                f"the sandbox server {session.server} confirmed {name}={got!r} where this trainer asked {want!r}: "
                "its sessions would not run as asked (an older or misconfigured server); refusing the session"
            )
