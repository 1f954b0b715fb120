"""How `RemoteSandbox` talks to its servers: one HTTP request with retries on the service's failures (backoff with
jitter, never sooner than `Retry-After` asks, capped), and which failures may be sent again. Runs in the trainer."""

from __future__ import annotations

import email.utils
import time

from .service import MemoryFull as _MemoryFull
from .service import ServiceFailure as _ServiceFailure

# A retry waits at most this long, whatever the backoff or the service's `Retry-After` says: past it, the rollout is
# better served by an infrastructure error (retried or dropped by the caller) than by a stalled batch.
_MAX_WAIT_S = 30.0

# The sleep between attempts, looked up at each call so that tests can record the delays instead of sleeping.
_sleep = time.sleep


class _Retryable(Exception):
    """A failure of the service that may pass on another attempt (transport, HTTP 5xx/429, bad JSON, SandboxError)."""

    def __init__(self, problem: str, retry_after: float | None = None):
        super().__init__(problem)
        self.retry_after = retry_after


def _retry_after(value: str | None) -> float | None:
    """Seconds asked by an HTTP `Retry-After` header (delta-seconds or HTTP-date), or `None`."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time()) if when.tzinfo else None


class Transport:
    """The requests of a `RemoteSandbox` (its `urls`, `retries`, `backoff_s`, `request_timeout_s` and HTTP client):
    `_post` for a replayed cell, `_request` for any call of the server's sessions (`service.py`)."""

    def _post(self, body: dict, run_timeout: float, server: str | None = None) -> dict:
        """POSTs with retries on failures of the service; returns the response JSON.

        Raises:
            `_ServiceFailure`: at once on an HTTP 4xx other than 429 (a bad request stays bad), or when the retries
                run out, with the last problem and the number of attempts.
        """
        timeout = self.request_timeout_s or run_timeout + 30.0
        return self._request("POST", server or self.url, "/run_code", body, timeout, True)

    def _request(
        self, method: str, server: str, path: str, body, timeout: float, resend: bool, memory_wait: bool = False
    ) -> dict:
        """One call with retries; `resend=False` retries only what the server surely did not run (429, 503, a
        connection never made). A server that cannot be reached gets no new sessions for a while. With
        `memory_wait`, a 429 marked `memory_full` raises `_MemoryFull` at once (the caller waits on it)."""
        import tenacity

        client, _ = self._start()
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(_Retryable),
            stop=tenacity.stop_after_attempt(self.retries + 1),
            wait=self._wait,
            sleep=_sleep,
        )
        try:
            return retrying(self._attempt, client, body, timeout, method, server + path, resend, memory_wait)
        except tenacity.RetryError as exc:
            last = exc.last_attempt
            failure = _ServiceFailure(f"{last.exception()} (after {last.attempt_number} attempts)", True)
        except _ServiceFailure as exc:
            failure = exc
        if failure.unreachable:
            self._mark_down(server)
        raise failure

    def _pause(self, seconds: float) -> None:
        """Sleeps between asks while waiting for a server's memory (`_sleep`, which tests record)."""
        _sleep(seconds)

    def _mark_down(self, server: str) -> None:
        """New sessions go to the other servers for a while (where there are others)."""
        if len(self.urls) > 1:
            self._down_until[server] = time.monotonic() + _MAX_WAIT_S

    def _wait(self, retry_state) -> float:
        """Delay before the next attempt: the backoff, or the service's `Retry-After` when longer (both capped)."""
        import tenacity

        backoff = tenacity.wait_exponential(multiplier=self.backoff_s) + tenacity.wait_random(0, self.backoff_s)
        asked = getattr(retry_state.outcome.exception(), "retry_after", None) or 0.0
        return min(max(backoff(retry_state), asked), _MAX_WAIT_S)

    def _attempt(
        self, client, body, timeout: float, method: str, url: str, resend: bool, memory_wait: bool = False
    ) -> dict:
        """One request. Raises `_Retryable` on a failure of the service, `_ServiceFailure` on a client error (and,
        with `resend=False`, on a failure after which the request may have been served)."""
        import httpx

        try:
            reply = client.request(method, url, json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            if resend or isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
                raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
            # A server that took the request and is slow to answer is busy, not gone: it keeps its new sessions.
            unreachable = not isinstance(exc, httpx.ReadTimeout)
            raise _ServiceFailure(f"{type(exc).__name__}: {exc}", unreachable=unreachable) from exc
        status = reply.status_code
        if not resend and status >= 500 and status != 503:
            raise _ServiceFailure(f"HTTP {status}: {reply.text[:200]}", status=status)
        # 409 with Retry-After: our server's session is still running an earlier cell and ran nothing of this one.
        if status >= 500 or status == 429 or (status == 409 and reply.headers.get("Retry-After")):
            asked = _retry_after(reply.headers.get("Retry-After")) if status in (409, 429, 503) else None
            if memory_wait and status == 429 and _error_of(reply) == "memory_full":
                raise _MemoryFull(_detail_of(reply), asked)
            raise _Retryable(f"HTTP {status}", asked)
        if status >= 400:
            raise _ServiceFailure(f"HTTP {status}: {reply.text[:200]}", status=status)  # a bad request stays bad
        try:
            data = reply.json()
        except ValueError:
            raise _Retryable("invalid JSON in the response") from None
        if not isinstance(data, dict) or data.get("status") == "SandboxError":
            raise _Retryable(f"SandboxError: {str(data.get('message', '') if isinstance(data, dict) else data)[:200]}")
        return data


def _error_of(reply) -> str | None:
    try:
        data = reply.json()
    except ValueError:
        return None
    return data.get("error") if isinstance(data, dict) else None


def _detail_of(reply) -> str:
    try:
        data = reply.json()
    except ValueError:
        return f"HTTP {reply.status_code}"
    return str(data.get("detail", "") if isinstance(data, dict) else data)[:300] or f"HTTP {reply.status_code}"
