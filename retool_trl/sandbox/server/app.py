"""The sandbox server's HTTP routes (starlette): SandboxFusion's `/run_code`, our stateful `/sessions`, `/health`
and `/metrics`; bearer-token check, 429 + `Retry-After` at a bound, idle expiry, and every jail killed at shutdown.

Sessions API (what `RemoteSandbox` uses when `/health` says `"sessions": 1`):

    POST   /sessions                 {"timeout_s"?, "memory_mb"?, "max_output_chars"?, "show_last_expression"?}
                                     -> {"session_id", "limits"}   (exactly the limits asked, or the defaults)
    POST   /sessions/{id}/run        {"code": str} or {"cells": [str, ...]}
                                     -> {"results": [{"output", "ok", "timed_out", "duration_s", "infra_error"}]}
    DELETE /sessions/{id}            -> {"closed": true}

A limit outside its range is a 400 naming the field and its range (`limits.py`); a run request for a session whose
cell is still running is a 409 with `Retry-After` (it never waits on a slot); an unknown session is a 404
(`{"error": "unknown_session"}`), and so is another tenant's session (a tenant's token opens its own sessions only):
the client reports its cells as infrastructure errors. A client is its tenant where
the server has per-tenant tokens, else its peer address (`clients.py`): it holds a bounded number of sessions and of
limit sets. A session whose `memory_mb` does not fit the memory budget's unreserved part, or its client's share of
it, is a 429 marked `{"error": "memory_full"}` (other bounds' 429s say `"busy"`): `RemoteSandbox` waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from . import fusion
from .clients import address_key, tenant_key
from .config import ServerConfig
from .http import BodyError, read_json
from .limits import LimitError, session_limits
from .table import Busy, Full, MemoryFull, SessionTable, TooLarge, UnknownSession

__all__ = ["SESSIONS_API_VERSION", "create_app"]

logger = logging.getLogger(__name__)

SESSIONS_API_VERSION = 1
RETRY_AFTER_S = "1"  # a cell takes milliseconds to seconds: a second later, a slot is likely free


def create_app(config: ServerConfig, table: SessionTable | None = None) -> Starlette:
    """The ASGI app serving `config` (`table` is built from it unless given)."""
    table = table or SessionTable(config)
    # Worker threads for blocking calls: one per running call at most (the bound is checked before, never queued).
    limiter = anyio.CapacityLimiter(config.max_concurrency + 8)

    # Compared in constant time each, all of them: neither a token's bytes nor its place shows in the reply's timing.
    tokens = [(f"Bearer {token}".encode(), tenant) for token, tenant in (config.tokens or {}).items()]
    if config.token:
        tokens = [(f"Bearer {config.token}".encode(), None)]

    def caller(request: Request) -> str | JSONResponse:
        """The client the request counts as for the per-client bounds, or the 401 reply for a missing/wrong token."""
        if not tokens:
            return address_key(request.client.host if request.client else None)
        given = request.headers.get("authorization", "").encode()
        found = False
        tenant = None
        for expected, name in tokens:
            if hmac.compare_digest(given, expected):
                found, tenant = True, name
        if not found:
            return JSONResponse(
                {"error": "unauthorized", "detail": "missing or wrong bearer token"},
                401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        if tenant is not None:
            return tenant_key(tenant)
        return address_key(request.client.host if request.client else None)

    def busy(error: Full) -> JSONResponse:
        # "memory_full": live sessions hold the memory budget (or this client's share); they free it as they close,
        # so a trainer may wait for it where another bound's 429 is worth only a few retries.
        kind = "memory_full" if isinstance(error, MemoryFull) else "busy"
        return JSONResponse({"error": kind, "detail": str(error)}, 429, headers={"Retry-After": RETRY_AFTER_S})

    async def blocking(fn, *args):
        return await anyio.to_thread.run_sync(fn, *args, limiter=limiter)

    async def body_of(request: Request):
        return await read_json(request, config.max_body_bytes, config.body_timeout_s)

    def bad(status: int, detail: str) -> JSONResponse:
        return JSONResponse({"error": "bad_request", "detail": detail}, status)

    async def run_code(request: Request):
        if isinstance(client := caller(request), JSONResponse):
            return client
        try:
            req = fusion.parse_request(await body_of(request))
            timeout, memory = config.clamp(req["run_timeout"], req["memory_limit_MB"])
        except BodyError as error:
            return JSONResponse({"detail": error.detail}, error.status)
        except fusion.RequestError as error:
            return JSONResponse({"detail": error.detail}, 422)
        except ValueError as error:
            return JSONResponse({"detail": [{"type": "value_error", "loc": ["body"], "msg": str(error)}]}, 422)
        if req["language"] not in fusion.PYTHON:
            return JSONResponse(fusion.unsupported(req["language"]))
        if req["fetch_files"]:
            return JSONResponse(fusion.reply("SandboxError", "fetch_files is not supported by this server", None))
        # Capped like the other limits (SandboxFusion's callers expect a cap, not a refusal): never past the budget,
        # nor past what one client may hold.
        memory = min(memory, table.memory_budget_mb, table.memory_per_client_mb)
        limits = {
            "timeout_s": timeout,
            "memory_mb": memory,
            "max_output_chars": config.max_output_chars,
            "show_last_expression": False,
        }
        try:
            table.reserve(memory, client)
        except Full as error:
            return busy(error)
        # From here on, whatever fails (a bound, or an error building the limit set's sandbox), each thing taken is
        # given back: the reservation, the running slot and the profile.
        try:
            try:
                table.acquire()
            except Full as error:
                return busy(error)
            try:
                try:
                    profile = await blocking(table.take_profile, limits, client)
                except Full as error:
                    return busy(error)
                try:
                    prelude = fusion.prelude(req)
                    result, before = await blocking(table.run_once, req["code"], profile, prelude)
                finally:
                    table.drop_profile(profile, client)
            finally:
                table.release()
        finally:
            table.unreserve(memory, client)
        return JSONResponse(fusion.response(result, prelude_error=before))

    async def open_session(request: Request):
        if isinstance(client := caller(request), JSONResponse):
            return client
        try:
            limits = session_limits(await body_of(request), config)
        except BodyError as error:
            return bad(error.status, error.detail)
        except LimitError as error:
            return bad(400, str(error))
        try:
            session_id, profile = await blocking(table.open, limits, client)
        except TooLarge as error:
            return bad(400, str(error))
        except Full as error:
            return busy(error)
        return JSONResponse({"session_id": session_id, "limits": profile.limits()})

    async def run_session(request: Request):
        if isinstance(client := caller(request), JSONResponse):
            return client
        try:
            body = await body_of(request)
        except BodyError as error:
            return bad(error.status, error.detail)
        cells = body.get("cells") if isinstance(body, dict) else None
        if isinstance(body, dict) and isinstance(body.get("code"), str):
            cells = [body["code"]]
        if not isinstance(cells, list) or not cells or not all(isinstance(c, str) for c in cells):
            return bad(400, 'send {"code": str} or {"cells": [str, ...]}')
        if len(cells) > config.max_cells_per_request:
            return bad(400, f"cells must hold 1 to {config.max_cells_per_request} cells here, got {len(cells)}")
        session_id = request.path_params["session_id"]
        try:
            live = table.begin(session_id, client)
        except UnknownSession:
            return _unknown()
        except Busy as error:
            detail = {"error": "session_busy", "detail": str(error)}
            return JSONResponse(detail, 409, headers={"Retry-After": RETRY_AFTER_S})
        except Full as error:
            table.touch(session_id, client)  # its client is there, retrying: not idle
            return busy(error)
        try:
            results = await blocking(table.run, live, cells)
        finally:
            table.end(live)
        return JSONResponse({"results": [dataclasses.asdict(r) for r in results]})

    async def close_session(request: Request):
        if isinstance(client := caller(request), JSONResponse):
            return client
        try:
            await blocking(table.close_session, request.path_params["session_id"], client)
        except UnknownSession:
            return _unknown()
        return JSONResponse({"closed": True})

    async def health(request: Request):
        snap = table.snapshot()
        body = {
            "status": "draining" if table.closed else "ok",
            "sessions": SESSIONS_API_VERSION,
            "isolation": app.state.isolation.get("isolation"),
            "missing": app.state.isolation.get("missing", []),
            "live_sessions": snap["live_sessions"],
            "running": snap["running"],
            "max_concurrency": config.max_concurrency,
            "cpu_slots": table.cpu_slots,
            "limit_profiles": snap["limit_profiles"],
            "reserved_memory_mb": snap["reserved_memory_mb"],
            "memory_budget_mb": snap["memory_budget_mb"],
        }
        return JSONResponse(body, 503 if table.closed else 200)

    async def metrics(request: Request):
        if isinstance(denied := caller(request), JSONResponse):
            return denied
        return PlainTextResponse(_prometheus(table.snapshot(), config), media_type="text/plain; version=0.0.4")

    async def expire_forever():
        period = min(30.0, max(0.5, min(config.idle_s, config.fresh_idle_s) / 4))
        while True:
            await asyncio.sleep(period)
            await blocking(table.expire)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        app.state.isolation = await blocking(table.isolation_report)
        expiry = asyncio.get_running_loop().create_task(expire_forever())
        try:
            yield
        finally:
            expiry.cancel()
            # uvicorn has let the running calls finish (or given up on them after `grace_s`): kill every jail.
            await blocking(table.close)
            logger.info("sandbox server stopped: every jail closed")

    routes = [
        Route("/run_code", run_code, methods=["POST"]),
        Route("/sessions", open_session, methods=["POST"]),
        Route("/sessions/{session_id}/run", run_session, methods=["POST"]),
        Route("/sessions/{session_id}", close_session, methods=["DELETE"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.table = table
    app.state.isolation = {}
    return app


def _unknown() -> JSONResponse:
    detail = "no such session here (closed, expired after its idle time, or the server restarted)"
    return JSONResponse({"error": "unknown_session", "detail": detail}, 404)


def _prometheus(snap: dict, config: ServerConfig) -> str:
    """The counters in Prometheus' text format (scraped as they are by any Prometheus-compatible agent)."""
    lines = [
        "# TYPE retool_sandbox_live_sessions gauge",
        f"retool_sandbox_live_sessions {snap['live_sessions']}",
        "# TYPE retool_sandbox_running_calls gauge",
        f"retool_sandbox_running_calls {snap['running']}",
        "# TYPE retool_sandbox_max_concurrency gauge",
        f"retool_sandbox_max_concurrency {config.max_concurrency}",
        "# TYPE retool_sandbox_limit_profiles gauge",
        f"retool_sandbox_limit_profiles {snap['limit_profiles']}",
        "# TYPE retool_sandbox_reserved_memory_mb gauge",
        f"retool_sandbox_reserved_memory_mb {snap['reserved_memory_mb']}",
        "# TYPE retool_sandbox_memory_budget_mb gauge",
        f"retool_sandbox_memory_budget_mb {snap['memory_budget_mb']}",
        "# TYPE retool_sandbox_events_total counter",
    ]
    lines += [f'retool_sandbox_events_total{{event="{k}"}} {v}' for k, v in sorted(snap["counts"].items())]
    lines.append("# TYPE retool_sandbox_cell_seconds_total counter")
    lines += [f'retool_sandbox_cell_seconds_total{{api="{k}"}} {v:.6f}' for k, v in sorted(snap["seconds"].items())]
    return "\n".join(lines) + "\n"
