"""HTTP to an OpenAI-compatible `/v1/completions` server (vLLM's): connections, replies and what their failures mean.

`CompletionsClient` owns the connection pool and turns every way a request can fail into the rollout's engine errors:
a timeout is `EngineTimeoutError`, a server that is down or overloaded (connection refused, HTTP 408, 429, 5xx) is
`EngineError` (the completion goes unscored), and a request the server refuses (another 4xx) is `EngineRequestError`,
a configuration error to fix. `read_choices` reads a reply's choices as they arrive, streamed or not. Which turns go
in which request is the engine's business (`vllm_server`), not this module's.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable

import httpx

from ..turns import EngineError, EngineRequestError, EngineTimeoutError


class CompletionsClient:
    """The connections to one server, opened by `open` and closed by `close`.

    A turn may legitimately take long (thousands of tokens on a loaded server), so by default there is no read
    timeout: only connecting is bounded, and a server that goes away (connection refused, reset or closed) fails the
    requests in flight at once. Connection failures are retried by httpx's transport, and a request sent on a
    kept-alive connection that the server closed at that moment is sent once more on a new one.

    Args:
        base_url: The server, e.g. `http://127.0.0.1:8000`.
        timeout_s: Longest wait for a reply, or `None` for no limit.
        connect_timeout_s: Longest wait to connect to the server.
        max_connections: Requests in flight at once.
        transport: An httpx transport to use instead of the network (tests).
    """

    def __init__(
        self,
        base_url: str,
        timeout_s: float | None = None,
        connect_timeout_s: float = 30.0,
        max_connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        # No pool timeout: the rollout bounds the requests in flight itself, a request waits for a free connection.
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s, pool=None)
        self.max_connections = max_connections
        self._transport = transport
        self._client: httpx.AsyncClient | None = None

    def open(self) -> None:
        # Idle connections are dropped before the server's own keep-alive timeout (uvicorn: 5 s) can close them under
        # a request; connection failures are retried by the transport.
        limits = httpx.Limits(
            max_connections=self.max_connections, max_keepalive_connections=self.max_connections, keepalive_expiry=2.0
        )
        transport = self._transport or httpx.AsyncHTTPTransport(retries=3, limits=limits)
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout, transport=transport)

    async def close(self) -> None:
        await self._client.aclose()
        self._client = None

    async def request(self, method: str, path: str, **kwargs) -> dict:
        """A plain request's JSON reply."""
        with _engine_errors(f"{method} {path}"):
            response = await _once_more_if_dropped(lambda: self._client.request(method, path, **kwargs))
        if response.status_code != 200:
            self.raise_for_status(method, path, response.status_code, response.text[:500])
        try:
            return response.json()
        except ValueError as exc:
            raise EngineError(f"{method} {path}: the reply is not JSON: {exc}") from exc

    @contextlib.asynccontextmanager
    async def stream(self, method: str, path: str, payload: dict):
        """The streamed reply to one request (closed on the way out: before its end, the server aborts the rest)."""
        send, build = self._client.send, self._client.build_request
        with _engine_errors(f"{method} {path}"):
            response = await _once_more_if_dropped(lambda: send(build(method, path, json=payload), stream=True))
        try:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:500]
                self.raise_for_status(method, path, response.status_code, text)
            yield response
        finally:
            await response.aclose()

    def raise_for_status(self, method: str, path: str, status: int, text: str) -> None:
        if status in (408, 429) or status >= 500:
            raise EngineError(f"{method} {path}: HTTP {status}: {text}")
        # The request itself is wrong (context past max_model_len, an unknown field, a wrong model name): a
        # configuration error to fix, not a failure to drop quietly from the loss.
        raise EngineRequestError(
            f"the vLLM server at {self.base_url} refused {method} {path} (HTTP {status}): {error_message(text)} "
            "(check that the server serves the policy model with the settings of the run, e.g. its --max_model_len)"
        )


async def _once_more_if_dropped(send: Callable):
    try:
        return await send()
    except (httpx.ReadError, httpx.RemoteProtocolError):
        # A kept-alive connection closed by the server as the request went out: once more, on a new one.
        return await send()


@contextlib.contextmanager
def _engine_errors(what: str):
    """httpx's failures as the rollout's: a timeout is the engine's timeout, any other failure the engine's."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise EngineTimeoutError(f"{what}: {type(exc).__name__}: {exc}") from exc
    except httpx.HTTPError as exc:
        raise EngineError(f"{type(exc).__name__}: {exc}") from exc


async def read_choices(
    response: httpx.Response, take: Callable[[dict, bool], None], finished: Callable[[], bool]
) -> None:
    """Hands each choice of a reply to `take(choice, final)` as it arrives, until the reply ends or `finished()`.

    A streamed reply (server-sent events) gives a choice per chunk and sequence (`final` False: the choice's own
    `finish_reason` says when its sequence is done); a server that answered with one JSON reply gives each prompt's
    whole choice at once (`final` True).
    """
    try:
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            for choice in reply_json(await response.aread()).get("choices") or []:
                take(choice, True)
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            chunk = reply_json(data)
            if "error" in chunk:
                # The request was accepted and failed while generating: the server's fault, not the request's.
                raise EngineError(f"the server failed while generating: {json.dumps(chunk['error'])[:500]}")
            for choice in chunk.get("choices") or []:
                take(choice, False)
            if finished():
                return  # nothing left to wait for: closing the stream aborts any sequence given up on
    except httpx.TimeoutException as exc:
        raise EngineTimeoutError(f"reading the reply: {type(exc).__name__}: {exc}") from exc
    except httpx.HTTPError as exc:
        raise EngineError(f"reading the reply: {type(exc).__name__}: {exc}") from exc


def error_message(text: str) -> str:
    """The message of an OpenAI-style error reply (`{"error": {"message": ...}}` or `{"message": ...}`), on one
    line; the raw text when it is not one."""
    try:
        body = json.loads(text)
        error = body.get("error", body) if isinstance(body, dict) else body
        message = error.get("message", text) if isinstance(error, dict) else text
    except ValueError:
        message = text
    return " ".join(str(message).split())[:500]


def reply_json(data: str | bytes) -> dict:
    try:
        return json.loads(data)
    except ValueError as exc:
        raise EngineError(f"the reply is not JSON: {exc}") from exc
