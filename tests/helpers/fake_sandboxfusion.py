"""A small SandboxFusion-like `run_code` server on 127.0.0.1 (stdlib http.server + subprocess) for the remote tests.

The real server (github.com/bytedance/SandboxFusion, not on PyPI, so it cannot run here) was run on 127.0.0.1 with
its default `isolation: none` configuration and compared with `LocalSandbox` cell by cell. Everything it did that
the client has to cope with is reproduced here, the way its source does it (`sandbox/runners/base.py`,
`sandbox/utils/execution.py`):

- the code is written to a file and run as `python <file>` in a fresh temporary directory, stdin closed;
- `memory_limit_MB` sets the soft RLIMIT_AS, RLIMIT_DATA *and RLIMIT_STACK* to that many MiB (so every thread the
  process starts reserves that much address space: `import numpy` fails unless its BLAS runs one thread);
- `execution_time` and the `run_timeout` count from the process's start: the interpreter's start-up included;
- stdout and stderr are pipes that asyncio stops draining once about 200 KB wait unread (its stream buffer plus the
  pipe's): a process that writes more blocks, and is reported as `TimeLimitExceeded` when `run_timeout` passes;
- the output is decoded as strict UTF-8; when that fails the whole stream becomes `[DecodeError] <the error>`;
- the interpreter's stdout encoding is strict UTF-8 (`print(chr(0xD800))` raises `UnicodeEncodeError`);
- a process killed by a signal has a negative `return_code`; a time-out has none.

It can also be told to fail like a service does (`failures`).
"""

import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# What the real server's asyncio pipes hold before the writer blocks (64 KiB pipe + 128 KiB stream buffer).
UNREAD_OUTPUT_LIMIT = 192 * 1024


def serve_fake():
    """A started FakeSandboxFusion on 127.0.0.1, served from a daemon thread, for a pytest fixture (yields it and
    shuts it down after)."""
    srv = FakeSandboxFusion()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


class FakeSandboxFusion(ThreadingHTTPServer):
    """Runs each request's code in a fresh interpreter, like SandboxFusion's `run_code`; can be told to fail."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests = []
        # Consumed one per request: "sandbox_error", "garbage", "drop" (close without a reply) or an HTTP status,
        # optionally with a Retry-After value ("503:2").
        self.failures = []
        self.lock = threading.Lock()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


def _limits(memory_mb):
    """The server's `preexec_fn` when `memory_limit_MB > 0`: soft limits only, the stack's included."""

    def apply():
        for kind in (resource.RLIMIT_AS, resource.RLIMIT_DATA, resource.RLIMIT_STACK):
            resource.setrlimit(kind, (memory_mb * 1024 * 1024, resource.getrlimit(kind)[1]))

    return apply if memory_mb > 0 else None


def _try_decode(data):
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        return f"[DecodeError] {exc}"


def _drain(stream, sink):
    """Reads a pipe until EOF or until the server's buffers are full, then stops reading (the writer blocks)."""
    while len(sink) < UNREAD_OUTPUT_LIMIT:
        chunk = stream.read1(UNREAD_OUTPUT_LIMIT - len(sink))
        if not chunk:
            return
        sink.extend(chunk)


def run_python(code, run_timeout, memory_mb):
    """One `run_result`, as the real server computes it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "code.py")
        with open(path, "w") as f:
            f.write(code)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env["PYTHONIOENCODING"] = "utf-8"  # a UTF-8 locale: strict encoding of the interpreter's stdout
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, path],
            cwd=tmp,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_limits(memory_mb),
            start_new_session=True,
        )
        out, err = bytearray(), bytearray()
        readers = [
            threading.Thread(target=_drain, args=pair, daemon=True)
            for pair in ((proc.stdout, out), (proc.stderr, err))
        ]
        for reader in readers:
            reader.start()
        try:
            proc.wait(timeout=run_timeout)
            status = "Finished"
        except subprocess.TimeoutExpired:
            status = "TimeLimitExceeded"
        execution_time = time.monotonic() - start
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the server kills the process tree
        except OSError:
            pass
        proc.wait()
        for reader in readers:
            reader.join(1.0)
        run = {
            "status": status,
            "execution_time": execution_time,
            "return_code": proc.returncode if status == "Finished" else None,
            "stdout": _try_decode(bytes(out)),
            "stderr": _try_decode(bytes(err)),
        }
        proc.stdout.close()
        proc.stderr.close()
        return run


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _reply(self, status, body, retry_after=""):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if retry_after:
            self.send_header("Retry-After", retry_after)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        server = self.server
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.requests.append((self.path, request))
            failure = server.failures.pop(0) if server.failures else None
        if self.path != "/run_code":
            return self._reply(404, {"detail": "not found"})
        if failure == "drop":
            self.close_connection = True
            return None
        if failure and failure[0].isdigit():
            status, _, retry_after = failure.partition(":")
            return self._reply(int(status), {"detail": "failure"}, retry_after)
        if failure == "garbage":
            return self._reply(200, b"<html>proxy error</html>")
        if failure == "sandbox_error":
            return self._reply(200, {"status": "SandboxError", "message": "executor pod died", "run_result": None})
        run = run_python(
            request["code"], float(request.get("run_timeout", 10)), int(request.get("memory_limit_MB", -1))
        )
        ok = run["status"] == "Finished" and run["return_code"] == 0
        return self._reply(
            200,
            {
                "status": "Success" if ok else "Failed",
                "message": "",
                "compile_result": None,
                "run_result": run,
                "executor_pod_name": None,
                "files": {},
            },
        )
