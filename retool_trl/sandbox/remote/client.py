"""`RemoteSandbox`: sessions on a SandboxFusion-compatible HTTP service (`POST {url}/run_code`), or on our own
sandbox server's stateful sessions when it offers them (`server/client.py`: the cells run in the session's jail
there, nothing is replayed). Several servers: each session is pinned to one for its life, by a hash of its id.

A plain SandboxFusion service is stateless (every request is a fresh interpreter), so a session replays its earlier
*successful* cells, with their output suppressed, before the new one. Cells that failed are not replayed: what the
model saw as an error leaves no state behind, like a notebook whose failed cell was deleted. The program sent
(`remote_driver.py`) runs the new cell as the local sandbox does, with the same limits, and reports one bounded JSON
line: the model sees the same text, `ok` and `timed_out` from both backends
(tests/sandbox/remote/test_sandboxfusion_client.py holds them to it, against a fake service that behaves like
SandboxFusion where it matters).

Why not the official `sandbox-fusion` client (0.3.7, read from its source): each call is a bare `requests.post` (a
new connection, no custom headers, so no authentication, no connection limit) or a new `aiohttp` session; it retries
*every* exception alike, HTTP 400 and response-validation errors included, with a fixed backoff (1-2 s, then doubling)
of which only the number of attempts can be set; its pydantic request model refuses any `language` outside a fixed
list; and it would bring `requests`, `aiohttp` and nine more packages next to the `httpx` already used here, for a
request of three JSON fields.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import weakref
import zlib
from collections.abc import Iterable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor

from ..base import ExecResult, SessionBase, check_pairs, refusal
from .driver import build_driver
from .replies import ReplyReading
from .service import DEFAULT_MEMORY_WAIT_S, close_remote, offers_sessions, run_remote
from .service import ServiceFailure as _ServiceFailure
from .transport import Transport

__all__ = ["RemoteSandbox", "RemoteSession"]

# How long `close()` waits for the sessions being closed on their servers.
_CLOSE_WAIT_S = 10.0


class RemoteSession(SessionBase):
    """A session on a `RemoteSandbox`: keeps the cells that succeeded and replays them before each new one."""

    def __init__(self, sandbox: RemoteSandbox, server: str):
        super().__init__(sandbox)
        self.id = uuid.uuid4().hex
        self.server = server  # the base URL this session uses for its whole life
        self._remote_id: str | None = None  # its id on a server that offers sessions, once opened there
        self._cells: list[str] = []
        self._numbers: list[int] = []  # the call number of each kept cell: tracebacks name cells as the local one does
        self._replay_s = 0.0  # time the kept cells took: the service's time limit leaves room to replay them
        self._lock = threading.Lock()  # one cell at a time per session, whatever the caller does

    def close(self) -> None:
        """Forgets the session's cells (or closes it on its server, in the background). Idempotent."""
        self._closed = True
        self._cells, self._numbers = [], []
        remote_id, self._remote_id = self._remote_id, None
        if remote_id is not None:
            sandbox = self._sandbox
            try:
                sandbox._track_close(sandbox._start()[1].submit(close_remote, sandbox, self.server, remote_id))
            except RuntimeError:  # the sandbox is closed: the server closes the session after its idle time
                pass


class RemoteSandbox(Transport, ReplyReading):
    """Stateful Python sessions on a SandboxFusion-compatible code execution service.

    On our sandbox server (`retool-trl sandbox-server`, whose `/health` says it offers sessions) a session is opened
    there at its first cell and each cell runs in its jail: no replay, and a session that the server loses (it
    went away, restarted or expired the session) ends with an `infra_error` result. On a plain SandboxFusion service
    each cell is one `POST {url}/run_code` request (`{"code", "language": "python", "run_timeout", "memory_limit_MB"}`)
    carrying the session's earlier successful cells (replayed silently) and the new cell, which gets the limits of a
    `LocalSandbox` cell (wall-clock and CPU time counted from its own start, memory, file size, output). Requests run
    concurrently, at most `max_concurrency` at once. Transport errors, HTTP 5xx/429, invalid JSON and `SandboxError`
    responses are retried (through `tenacity`) with exponential backoff and jitter, never sooner than an HTTP
    `Retry-After` asks; another HTTP 4xx, a cell's own exception or its timeout never is. A session's open that our
    server refuses for memory (`429`, `memory_full`) is waited for instead, up to `memory_wait_s`. When retries run
    out, or on that 4xx, the cell gets `ExecResult(ok=False, infra_error=True)`.

    Args:
        url (`str` or `list[str]`): Base URL of the service, e.g. `"http://sandbox:8080"`, or several (a list, or
            one string with commas): each session uses the one its id hashes to, skipping those that failed lately.
        timeout_s (`float`, defaults to `5.0`): Wall-clock limit of one cell, counted from its start (the service's
            `run_timeout` adds room for the interpreter's start and the replay).
        memory_mb (`int`, defaults to `1024`): Address-space limit of the session's interpreter (sent to the service
            as `memory_limit_MB`, and set by the program itself where the service ignores it).
        cpu_time_s (`float`, *optional*): CPU seconds one cell may use (default: `timeout_s + 1`).
        max_file_size_mb (`int`, defaults to `16`): Largest file a cell may write.
        max_concurrency (`int`, defaults to `32`): Requests in flight at once.
        retries (`int`, defaults to `3`): Extra attempts after a failure of the service.
        backoff_s (`float`, defaults to `0.5`): First retry delay; doubled each time (at most 30 s), plus a random
            jitter of up to `backoff_s` so that the retries of a batch do not arrive together.
        request_timeout_s (`float`, *optional*): HTTP timeout of one request (default: the run timeout + 30 s; on
            our sandbox server a session's cell waits as long as the server answers its `/health`, since a busy
            server's late answer is the cell's and a timeout would lose the session's state).
        max_output_chars (`int`, defaults to `4096`): Longer output keeps its beginning and end around a marker.
        show_last_expression (`bool`, defaults to `True`): Show a trailing expression's repr when nothing printed.
        language (`str`, defaults to `"python"`): The service's language name for Python.
        headers (`dict`, *optional*): Extra HTTP headers (e.g. authentication for the service).
        token (`str`, *optional*): Sent as `Authorization: Bearer <token>` (the sandbox server's `--token`, or this
            tenant's token from its `--tokens-file`; default: `$RETOOL_SANDBOX_TOKEN`).
        sessions (`str`, defaults to `"auto"`): `"auto"` (the server's sessions when it offers them, else replay),
            `"native"` (fail with a clear error where they are not offered) or `"replay"`.
        memory_wait_s (`float`, defaults to `600`): On our sandbox server, how long a session's open waits while the
            server's memory budget is reserved by live sessions (a `429` marked `memory_full`; sessions close as
            their rollouts end), not counted against `retries`. Past it the cell is an `infra_error` whose line
            names the fix (the server's `--total-memory-mb`, or a smaller `memory_mb`).
    """

    def __init__(
        self,
        url: str | list[str],
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
        cpu_time_s: float | None = None,
        max_file_size_mb: int = 16,
        max_concurrency: int = 32,
        retries: int = 3,
        backoff_s: float = 0.5,
        request_timeout_s: float | None = None,
        max_output_chars: int = 4096,
        show_last_expression: bool = True,
        language: str = "python",
        headers: dict[str, str] | None = None,
        token: str | None = None,
        sessions: str = "auto",
        memory_wait_s: float = DEFAULT_MEMORY_WAIT_S,
    ):
        urls = url.split(",") if isinstance(url, str) else list(url or [])
        self.urls = [u.strip().rstrip("/") for u in urls if u and u.strip()]
        if not self.urls:
            raise ValueError("RemoteSandbox needs the service's url (sandbox_url: one URL or a list)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if sessions not in ("auto", "native", "replay"):
            raise ValueError(f"sessions must be 'auto', 'native' or 'replay', got {sessions!r}")
        self.sessions = sessions
        self.memory_wait_s = max(0.0, float(memory_wait_s))
        self.url = self.urls[0]
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.cpu_time_s = float(cpu_time_s if cpu_time_s is not None else timeout_s + 1)
        self.max_file_size_mb = int(max_file_size_mb)
        self.max_concurrency = max(1, int(max_concurrency))
        self.retries = max(0, int(retries))
        self.backoff_s = float(backoff_s)
        self.request_timeout_s = request_timeout_s
        self.max_output_chars = int(max_output_chars)
        self.show_last_expression = bool(show_last_expression)
        self.language = language
        self.headers = dict(headers or {})
        token = token or os.environ.get("RETOOL_SANDBOX_TOKEN")
        if token and "Authorization" not in self.headers:
            self.headers["Authorization"] = f"Bearer {token}"
        self._native: dict[str, bool] = {}  # server -> offers sessions (known once it answered)
        self._down_until: dict[str, float] = {}  # server -> when to try it again for new sessions
        self._client = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._closing: set = set()  # sessions being closed on their server: `close()` lets them finish
        self._closing_lock = threading.Lock()
        self._finalizer = weakref.finalize(self, RemoteSandbox._shutdown, [None, None])

    # ------------------------------------------------------------------------------------------------ lifecycle

    def _start(self):
        """Creates the HTTP client and thread pool on first use."""
        with self._lock:
            if self._closed:
                raise RuntimeError("RemoteSandbox is closed")
            if self._client is None:
                import httpx

                limits = httpx.Limits(
                    max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency
                )
                self._client = httpx.Client(limits=limits, headers=self.headers)
                self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="retool-remote-sandbox")
                self._finalizer.detach()
                self._finalizer = weakref.finalize(self, RemoteSandbox._shutdown, [self._client, self._pool])
            return self._client, self._pool

    @staticmethod
    def _shutdown(box: list) -> None:
        client, pool = box
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if client is not None:
            client.close()

    def close(self) -> None:
        """Closes the HTTP client, once the sessions closed before have been closed on their servers (or a few
        seconds passed: a server that does not answer closes them after its idle time). Idempotent."""
        with self._closing_lock:
            pending = list(self._closing)
        futures.wait(pending, timeout=_CLOSE_WAIT_S)  # before `_closed`: their requests need the client
        with self._lock:
            self._closed = True
        self._finalizer()

    def _track_close(self, closing: futures.Future) -> None:
        with self._closing_lock:
            self._closing.add(closing)

        def done(future):
            with self._closing_lock:
                self._closing.discard(future)

        closing.add_done_callback(done)

    def __enter__(self) -> RemoteSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------- running

    def reserve(self, n: int) -> None:
        """Nothing to prepare: a remote session is only a list of cells until its first call (the sandbox
        interface's `reserve`, a no-op here)."""

    def session(self) -> RemoteSession:
        """A new, empty session."""
        if self._closed:
            raise RuntimeError("RemoteSandbox is closed")
        session = RemoteSession(self, self.urls[0])
        now = time.monotonic()
        up = [u for u in self.urls if self._down_until.get(u, 0.0) <= now] or self.urls
        session.server = up[zlib.crc32(session.id.encode()) % len(up)]
        return session

    def run_many(self, pairs: Iterable[tuple[RemoteSession, str]]) -> list[ExecResult]:
        """Runs `(session, code)` pairs concurrently; results come back in input order (one session's in order)."""
        pairs = check_pairs(pairs)
        by_session: dict[RemoteSession, list[int]] = {}
        for i, (session, _) in enumerate(pairs):
            if not isinstance(session, RemoteSession) or session._sandbox is not self:
                raise ValueError(f"run_many item {i}: the session does not belong to this RemoteSandbox")
            by_session.setdefault(session, []).append(i)
        _, pool = self._start()
        results: list[ExecResult | None] = [None] * len(pairs)

        def run_session(session: RemoteSession, indices: list[int]) -> None:
            with session._lock:
                for i in indices:
                    results[i] = self._run_cell(session, pairs[i][1])

        futures = [pool.submit(run_session, s, idx) for s, idx in by_session.items()]
        for future in futures:
            future.result()
        return results  # type: ignore[return-value]

    def _offers_sessions(self, server: str) -> bool:
        """Whether `server` offers our sessions (asked once per server; `sessions="native"` insists)."""
        if self.sessions == "replay":
            return False
        if server not in self._native:
            offered = offers_sessions(self._start()[0], server)
            if offered is not None:
                self._native[server] = offered
        offered = self._native.get(server, self.sessions == "native")
        if self.sessions == "native" and server in self._native and not offered:
            raise RuntimeError(f"{server} offers no sessions (not a retool-trl sandbox-server); use sessions='auto'")
        return offered

    def _run_cell(self, session: RemoteSession, code: str) -> ExecResult:
        refused = refusal(session._closed, session._broken)
        if refused is not None:
            return refused
        if session._remote_id is not None or (not session._cells and self._offers_sessions(session.server)):
            session.calls += 1
            return run_remote(self, session, code)
        session.calls += 1
        start = time.monotonic()
        # The program holds the cell to `timeout_s` itself; the service's limit also covers the interpreter's start
        # and the replay of the kept cells (which took `_replay_s` when they ran), and only ends a stuck replay.
        run_timeout = self.timeout_s + 2 * session._replay_s + _STARTUP_S
        driver = build_driver(
            [*session._cells, code],
            [*session._numbers, session.calls],
            timeout_s=self.timeout_s,
            cpu_time_s=self.cpu_time_s,
            memory_mb=self.memory_mb,
            max_file_size_mb=self.max_file_size_mb,
            max_output_chars=self.max_output_chars,
            show=self.show_last_expression,
        )
        body = {
            "code": driver,
            "language": self.language,
            "run_timeout": run_timeout,
            "memory_limit_MB": self.memory_mb,
        }
        try:
            response = self._post(body, run_timeout, session.server)
        except _ServiceFailure as exc:
            return ExecResult(
                f"SandboxError: the code execution service failed: {exc}",
                ok=False,
                timed_out=False,
                duration_s=time.monotonic() - start,
                infra_error=True,
            )
        duration = time.monotonic() - start
        return self._result(session, code, response, duration)


# Room in the service's time limit for the interpreter's start and the program's report, on top of the cell's.
_STARTUP_S = 10.0
