"""`RemoteSandbox`: sessions on a SandboxFusion-compatible HTTP service (`POST {url}/run_code`).

The service is stateless (every request is a fresh interpreter), so a session replays its earlier *successful* cells,
with their output suppressed, before the new one. Cells that failed are not replayed: what the model saw as an error
leaves no state behind, like a notebook whose failed cell was deleted.

Why not the official `sandbox-fusion` client (0.3.7, read from its source): each call is a bare `requests.post` (a
new connection, no custom headers, so no authentication, no connection limit) or a new `aiohttp` session; it retries
*every* exception alike, HTTP 400 and response-validation errors included, with a fixed backoff (1-2 s, then doubling)
of which only the number of attempts can be set; its pydantic request model refuses any `language` outside a fixed
list; and it would bring `requests`, `aiohttp` and nine more packages next to the `httpx` already used here, for a
request of three JSON fields.
"""

from __future__ import annotations

import base64
import email.utils
import json
import threading
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from .base import ExecResult, SessionBase, check_pairs, refusal, truncate_output

__all__ = ["RemoteSandbox", "RemoteSession"]

# The program sent to the service. Exit code: 0 = the cell ran, 1 = it raised (the traceback is on stderr),
# 3 = replaying an earlier cell failed. Everything it defines lives outside the cells' namespace.
_DRIVER = r"""
import ast, base64, json, linecache, os, sys, traceback

CELLS, NUMBERS = json.loads(base64.b64decode("@PAYLOAD@"))  # sources, and their call numbers (like a notebook)
SHOW = @SHOW@


class Counting:
    def __init__(self, stream, counter):
        self.stream, self.counter = stream, counter

    def write(self, text):
        self.counter[0] += len(text)
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def register(source, name):
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)


def report(exc, err):
    te = traceback.TracebackException.from_exception(exc)
    frames = [] if isinstance(exc, SyntaxError) else [f for f in te.stack if f.filename.startswith("<cell-")][-5:]
    if frames:
        err.write("Traceback (most recent call last):\n")
        err.write("".join(traceback.StackSummary.from_list(frames).format()))
    only = list(te.format_exception_only())
    err.write("".join(only) if isinstance(exc, SyntaxError) else " ".join("".join(only).split()) + "\n")


def main():
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    real = (os.dup(1), os.dup(2), sys.stdout, sys.stderr)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    sys.stdout = sys.stderr = open(os.devnull, "w")
    failed = None
    for i, source in zip(NUMBERS, CELLS[:-1]):
        try:
            register(source, "<cell-%d>" % i)
            exec(compile(source, "<cell-%d>" % i, "exec"), ns)
        except SystemExit as exc:
            if exc.code not in (None, 0):  # a cell that ended with sys.exit(0) succeeded, and ends there again
                failed = "SessionError: replaying earlier cell %d failed (SystemExit); the session state is lost\n" % i
                break
        except BaseException as exc:
            failed = "SessionError: replaying earlier cell %d failed (%s); the session state is lost\n" % (
                i, type(exc).__name__)
            break
    sys.stdout.flush()
    if failed:
        os.write(real[1], failed.encode())
        os._exit(3)
    # What the cell prints on stderr lands with its stdout, in order, as in the local sandbox; the service's stderr
    # carries only this driver's account of an exception.
    os.dup2(real[0], 1)
    os.dup2(real[0], 2)
    counter = [0]
    sys.stdout = sys.stderr = Counting(real[2], counter)
    err = os.fdopen(real[1], "w")  # the service's stderr (fd 2 itself now points at stdout)
    name = "<cell-%d>" % NUMBERS[-1]
    code = 0
    try:
        register(CELLS[-1], name)
        tree = ast.parse(CELLS[-1], name)
        last = None
        if SHOW and tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, name, "exec"), ns)
        if last is not None:
            value = eval(compile(last, name, "eval"), ns)
            if value is not None and counter[0] == 0:
                print(repr(value))
    except SystemExit as exc:
        err.write("SystemExit: %s\n" % (exc.code,))
        code = 0 if exc.code in (None, 0) else 1
    except BaseException as exc:
        report(exc, err)
        code = 1
    real[2].flush()
    err.flush()
    os._exit(code)


main()
"""


def _driver(cells: list[str], numbers: list[int], show_last_expression: bool) -> str:
    payload = base64.b64encode(json.dumps([cells, numbers]).encode()).decode()
    return _DRIVER.replace("@PAYLOAD@", payload).replace("@SHOW@", repr(bool(show_last_expression)))


# A retry waits at most this long, whatever the backoff or the service's `Retry-After` says: past it, the rollout is
# better served by an infrastructure error (retried or dropped by the caller) than by a stalled batch.
_MAX_WAIT_S = 30.0

# The sleep between attempts, looked up at each call so that tests can record the delays instead of sleeping.
_sleep = time.sleep


class _ServiceFailure(Exception):
    """The service failed (after retries where retrying made sense): an infrastructure error, not the cell's."""


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


class RemoteSession(SessionBase):
    """A session on a `RemoteSandbox`: keeps the cells that succeeded and replays them before each new one."""

    def __init__(self, sandbox: RemoteSandbox):
        super().__init__(sandbox)
        self._cells: list[str] = []
        self._numbers: list[int] = []  # the call number of each kept cell: tracebacks name cells as the local one does
        self._replay_s = 0.0  # time the kept cells took, added to the next request's time limit
        self._lock = threading.Lock()  # one cell at a time per session, whatever the caller does

    def close(self) -> None:
        """Forgets the session's cells. Idempotent."""
        self._closed = True
        self._cells, self._numbers = [], []


class RemoteSandbox:
    """Stateful Python sessions on a SandboxFusion-compatible code execution service.

    Each cell is one `POST {url}/run_code` request (`{"code", "language": "python", "run_timeout"}`) carrying the
    session's earlier successful cells (replayed silently) and the new cell. Requests run concurrently, at most
    `max_concurrency` at once. Transport errors, HTTP 5xx/429, invalid JSON and `SandboxError` responses are retried
    (through `tenacity`) with exponential backoff and jitter, never sooner than an HTTP `Retry-After` asks; another
    HTTP 4xx, a cell's own exception or its timeout never is. When retries run out, or on that 4xx, the cell gets
    `ExecResult(ok=False, infra_error=True)`.

    Args:
        url (`str`): Base URL of the service, e.g. `"http://sandbox:8080"`.
        timeout_s (`float`, defaults to `5.0`): Time limit of one cell (the service's `run_timeout`).
        max_concurrency (`int`, defaults to `32`): Requests in flight at once.
        retries (`int`, defaults to `3`): Extra attempts after a failure of the service.
        backoff_s (`float`, defaults to `0.5`): First retry delay; doubled each time (at most 30 s), plus a random
            jitter of up to `backoff_s` so that the retries of a batch do not arrive together.
        request_timeout_s (`float`, *optional*): HTTP timeout of one request (default: the run timeout + 30 s).
        max_output_chars (`int`, defaults to `4096`): Longer output keeps its beginning and end around a marker.
        show_last_expression (`bool`, defaults to `True`): Show a trailing expression's repr when nothing printed.
        language (`str`, defaults to `"python"`): The service's language name for Python.
        headers (`dict`, *optional*): Extra HTTP headers (e.g. authentication for the service).
    """

    def __init__(
        self,
        url: str,
        timeout_s: float = 5.0,
        max_concurrency: int = 32,
        retries: int = 3,
        backoff_s: float = 0.5,
        request_timeout_s: float | None = None,
        max_output_chars: int = 4096,
        show_last_expression: bool = True,
        language: str = "python",
        headers: dict[str, str] | None = None,
    ):
        if not url:
            raise ValueError("RemoteSandbox needs the service's url")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.url = url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.max_concurrency = max(1, int(max_concurrency))
        self.retries = max(0, int(retries))
        self.backoff_s = float(backoff_s)
        self.request_timeout_s = request_timeout_s
        self.max_output_chars = int(max_output_chars)
        self.show_last_expression = bool(show_last_expression)
        self.language = language
        self.headers = dict(headers or {})
        self._client = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False
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
        """Closes the HTTP client. Idempotent."""
        with self._lock:
            self._closed = True
        self._finalizer()

    def __enter__(self) -> RemoteSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------- running

    def session(self) -> RemoteSession:
        """A new, empty session."""
        if self._closed:
            raise RuntimeError("RemoteSandbox is closed")
        return RemoteSession(self)

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

    def _run_cell(self, session: RemoteSession, code: str) -> ExecResult:
        refused = refusal(session._closed, session._broken)
        if refused is not None:
            return refused
        session.calls += 1
        start = time.monotonic()
        run_timeout = self.timeout_s + session._replay_s
        body = {
            "code": _driver([*session._cells, code], [*session._numbers, session.calls], self.show_last_expression),
            "language": self.language,
            "run_timeout": run_timeout,
        }
        try:
            response = self._post(body, run_timeout)
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

    def _post(self, body: dict, run_timeout: float) -> dict:
        """POSTs with retries on failures of the service; returns the response JSON.

        Raises:
            `_ServiceFailure`: at once on an HTTP 4xx other than 429 (a bad request stays bad), or when the retries
                run out, with the last problem and the number of attempts.
        """
        import tenacity

        client, _ = self._start()
        timeout = self.request_timeout_s or run_timeout + 30.0
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(_Retryable),
            stop=tenacity.stop_after_attempt(self.retries + 1),
            wait=self._wait,
            sleep=_sleep,
        )
        try:
            return retrying(self._attempt, client, body, timeout)
        except tenacity.RetryError as exc:
            last = exc.last_attempt
            raise _ServiceFailure(f"{last.exception()} (after {last.attempt_number} attempts)") from None

    def _wait(self, retry_state) -> float:
        """Delay before the next attempt: the backoff, or the service's `Retry-After` when longer (both capped)."""
        import tenacity

        backoff = tenacity.wait_exponential(multiplier=self.backoff_s) + tenacity.wait_random(0, self.backoff_s)
        asked = getattr(retry_state.outcome.exception(), "retry_after", None) or 0.0
        return min(max(backoff(retry_state), asked), _MAX_WAIT_S)

    def _attempt(self, client, body: dict, timeout: float) -> dict:
        """One request. Raises `_Retryable` on a failure of the service, `_ServiceFailure` on a client error."""
        import httpx

        try:
            reply = client.post(f"{self.url}/run_code", json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            raise _Retryable(f"{type(exc).__name__}: {exc}") from exc
        if reply.status_code >= 500 or reply.status_code == 429:
            asked = _retry_after(reply.headers.get("Retry-After")) if reply.status_code in (429, 503) else None
            raise _Retryable(f"HTTP {reply.status_code}", asked)
        if reply.status_code >= 400:
            raise _ServiceFailure(f"HTTP {reply.status_code}: {reply.text[:200]}")  # a bad request stays bad
        try:
            data = reply.json()
        except ValueError:
            raise _Retryable("invalid JSON in the response") from None
        if not isinstance(data, dict) or data.get("status") == "SandboxError":
            raise _Retryable(f"SandboxError: {str(data.get('message', '') if isinstance(data, dict) else data)[:200]}")
        return data

    def _result(self, session: RemoteSession, code: str, response: dict, duration: float) -> ExecResult:
        run = response.get("run_result") or {}
        # JSON may carry lone surrogates ("\udcff" for a raw byte): the model only ever sees valid UTF-8 text.
        stdout, stderr = (str(run.get(key) or "").encode("utf-8", "replace").decode() for key in ("stdout", "stderr"))
        status, return_code = run.get("status"), run.get("return_code")
        if status == "TimeLimitExceeded":
            session._broken = "timeout"
            printed = truncate_output(stdout + stderr, self.max_output_chars) if stdout or stderr else ""
            return ExecResult(
                printed + f"TimeoutError: execution exceeded {self.timeout_s:g} s",
                ok=False,
                timed_out=True,
                duration_s=duration,
            )
        if return_code == 0 and status == "Finished":
            session._cells.append(code)
            session._numbers.append(session.calls)
            session._replay_s += float(run.get("execution_time") or 0.0)
            return ExecResult(
                truncate_output(stdout + stderr, self.max_output_chars), ok=True, timed_out=False, duration_s=duration
            )
        output = truncate_output(stdout, self.max_output_chars)
        if return_code in (1, 3) and stderr:
            if return_code == 3:
                session._broken = "replay failure"
            return ExecResult(
                output + truncate_output(stderr, self.max_output_chars, "tail"),
                ok=False,
                timed_out=False,
                duration_s=duration,
            )
        # Killed by a signal or a limit of the service, or no program run at all (compile stage, bad language).
        session._broken = "crash"
        tail = truncate_output(stderr, self.max_output_chars, "tail")
        reason = f"exited with code {return_code}" if return_code is not None else f"ended with status {status}"
        line = f"SystemError: the interpreter process {reason}"
        return ExecResult(
            output + tail + ("" if not tail or tail.endswith("\n") else "\n") + line,
            ok=False,
            timed_out=False,
            duration_s=duration,
        )
