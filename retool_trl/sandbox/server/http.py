"""Bounds on what a client sends, in size and in time: the request head must come within `header_timeout_s` of the
connection opening (or of its last reply), and the body within `body_timeout_s` and `max_body_bytes`. uvicorn bounds
the head's size (h11's incomplete-event limit) but has no time limit on it: a client sending its head a byte at a time
would hold its connection forever, so the protocol is extended here with one."""

from __future__ import annotations

import asyncio
import json

from starlette.requests import Request

__all__ = ["BodyError", "head_timeout_protocol", "read_json"]


class BodyError(Exception):
    """The body was too large (413), too slow (408) or not JSON (400): `status` and a line for the reply."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail


async def read_json(request: Request, max_bytes: int, timeout_s: float):
    """The request's JSON body (`None` when empty), read within `max_bytes` and `timeout_s`.

    Raises:
        `BodyError`: 413 past `max_bytes` (said at once when `Content-Length` says so), 408 past `timeout_s`, 400
            for a body that is not JSON.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyError(413, f"the body is {declared} bytes; this server takes at most {max_bytes}")

    async def gather() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise BodyError(413, f"the body is over {max_bytes} bytes, this server's bound")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        raw = await asyncio.wait_for(gather(), timeout_s)
    except TimeoutError:
        raise BodyError(408, f"the body did not arrive within {timeout_s:g} s") from None
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes ([[[[...)
        raise BodyError(400, "the body is not valid JSON (or nests too deep)") from None


def head_timeout_protocol(timeout_s: float):
    """uvicorn's h11 protocol, closing a connection whose request head is not complete `timeout_s` after the
    connection opened or after the head's first bytes came (a slow or stalled client); an idle kept-alive connection
    is uvicorn's `timeout_keep_alive`'s. Passed as `uvicorn.run(http=...)`."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimeoutProtocol(H11Protocol):
        _head_timer = None

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(timeout_s, self._head_late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self) -> None:
            self._head_timer = None
            waiting = self.cycle is None or self.cycle.response_complete  # no request of its own is being served
            if waiting and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._arm()  # the first bytes of a next head on a kept-alive connection: its clock starts now
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a whole head came: the body has its own time limit (`read_json`)

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeadTimeoutProtocol
