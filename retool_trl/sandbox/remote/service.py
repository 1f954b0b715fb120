"""The client side of the sandbox server's sessions, used by `RemoteSandbox` (httpx only, no server dependency).

A session lives on one server for its life; its cells run there in its jail, so nothing is replayed. What can go
wrong and what the cell then gets:

- the server is busy (429) or cannot be reached before the request is sent: retried with backoff, as for
  SandboxFusion;
- the connection breaks after the cell was sent, the server answers 5xx, or it no longer knows the session (it
  restarted, or the session expired): the cell may or may not have run and the session's state is gone, so the
  session ends with an `infra_error` result (the rollout retries that completion), never a snippet error.
"""

from __future__ import annotations

import logging
import time

from ..base import ExecResult

__all__ = ["SESSIONS_PATH", "ServiceFailure", "close_remote", "offers_sessions", "run_remote"]

logger = logging.getLogger(__name__)

SESSIONS_PATH = "/sessions"
_PROBE_TIMEOUT_S = 10.0


class ServiceFailure(Exception):
    """The service failed (after retries where retrying made sense): an infrastructure error, not the cell's.
    `unreachable`: the server could not be reached or dropped the connection (it may be gone)."""

    def __init__(self, problem: str, unreachable: bool = False):
        super().__init__(problem)
        self.unreachable = unreachable


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
            opened = sandbox._request("POST", session.server, SESSIONS_PATH, limits, _PROBE_TIMEOUT_S + 20, True)
            session._remote_id = str(opened["session_id"])
            _warn_if_clamped(sandbox, opened.get("limits") or {})
        path = f"{SESSIONS_PATH}/{session._remote_id}/run"
        timeout = sandbox.request_timeout_s or sandbox.timeout_s + 30.0
        # Not retried once sent: the cell may have run, and running it twice would change the session's state.
        reply = sandbox._request("POST", session.server, path, {"code": code}, timeout, False)
        result = ExecResult(**reply["results"][0])
    except (ServiceFailure, KeyError, IndexError, TypeError, ValueError) as exc:
        session._broken = "infrastructure error"
        line = f"SandboxError: the sandbox server {session.server} failed: {exc}; the session state is lost"
        return ExecResult(line, ok=False, timed_out=False, duration_s=time.monotonic() - start, infra_error=True)
    if result.infra_error:
        session._broken = "infrastructure error"
    return result


def close_remote(sandbox, server: str, remote_id: str) -> None:
    """Closes a session on its server (best effort: the server also closes it after its idle time)."""
    try:
        sandbox._request("DELETE", server, f"{SESSIONS_PATH}/{remote_id}", None, _PROBE_TIMEOUT_S, False)
    except ServiceFailure as exc:
        logger.debug("closing session %s on %s: %s", remote_id, server, exc)


_warned: set[tuple] = set()


def _warn_if_clamped(sandbox, limits: dict) -> None:
    """Says once when the server gives less than asked (its own maxima): cells may then fail where local ones pass."""
    asked = {"timeout_s": sandbox.timeout_s, "memory_mb": sandbox.memory_mb}
    lower = {k: limits[k] for k in asked if k in limits and float(limits[k]) < float(asked[k])}
    key = (id(sandbox), tuple(sorted(lower.items())))
    if lower and key not in _warned:
        _warned.add(key)
        logger.warning(
            "the sandbox server lowered this trainer's limits to its maxima: asked %s, got %s", asked, lower
        )
