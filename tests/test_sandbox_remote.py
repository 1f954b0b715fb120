"""`RemoteSandbox` against a small SandboxFusion-like server on 127.0.0.1 (stdlib http.server + subprocess)."""

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from retool_trl.sandbox import RemoteSandbox, build_sandbox

pytestmark = pytest.mark.timeout(60)


class FakeSandboxFusion(ThreadingHTTPServer):
    """Runs each request's code in a fresh `python -I`, like SandboxFusion's `run_code`; can be told to fail."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests = []
        self.failures = []  # consumed one per request: "500", "sandbox_error", "garbage"
        self.lock = threading.Lock()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _reply(self, status, body):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
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
        if failure == "500":
            return self._reply(500, {"detail": "internal"})
        if failure == "garbage":
            return self._reply(200, b"<html>proxy error</html>")
        if failure == "sandbox_error":
            return self._reply(200, {"status": "SandboxError", "message": "executor pod died", "run_result": None})
        start = time.monotonic()
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-c", request["code"]],
                capture_output=True,
                text=True,
                errors="surrogateescape",
                timeout=float(request["run_timeout"]),
            )
            run = {"status": "Finished", "return_code": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}
        except subprocess.TimeoutExpired as exc:
            run = {
                "status": "TimeLimitExceeded",
                "return_code": None,
                "stdout": (exc.stdout or b"").decode(errors="replace"),
                "stderr": (exc.stderr or b"").decode(errors="replace"),
            }
        run["execution_time"] = time.monotonic() - start
        ok = run["status"] == "Finished" and run["return_code"] == 0
        self._reply(
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


@pytest.fixture(scope="module")
def server():
    srv = FakeSandboxFusion()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def sandbox(server):
    server.failures.clear()
    with RemoteSandbox(
        server.url, timeout_s=3.0, max_concurrency=8, retries=2, backoff_s=0.01, max_output_chars=500
    ) as sb:
        yield sb


def _last_line(result):
    return result.output.rstrip("\n").splitlines()[-1]


def test_state_is_replayed_silently(sandbox, server):
    s = sandbox.session()
    first = s.run("x = 6 * 7\nprint(x)")
    assert first.ok and first.output == "42\n"
    second = s.run("print(x + 1)")
    assert second.ok and second.output == "43\n"  # cell 1's print is not repeated
    path, request = server.requests[-1]
    assert path == "/run_code" and request["language"] == "python" and request["run_timeout"] >= 3.0
    other = sandbox.session()
    r = other.run("print(x)")
    assert not r.ok and _last_line(r) == "NameError: name 'x' is not defined"


def test_failed_cells_are_not_replayed(sandbox):
    s = sandbox.session()
    assert s.run("items = [1]").ok
    bad = s.run("items.append(2)\n1/0")
    assert not bad.ok and not bad.infra_error and _last_line(bad) == "ZeroDivisionError: division by zero"
    assert "<cell-2>" in bad.output and "Traceback" in bad.output
    assert s.run("print(items)").output == "[1]\n"
    assert not s.broken


def test_expression_display_and_truncation(sandbox):
    s = sandbox.session()
    assert s.run("6 * 7").output == "42\n"
    assert s.run("print('p')\n6 * 7").output == "p\n"
    long = s.run("for i in range(10000):\n    print(i)")
    assert long.ok and len(long.output) <= 500 and "characters elided" in long.output
    assert long.output.startswith("0\n1\n") and long.output.endswith("9999\n")


def test_timeout_is_reported_and_breaks_the_session(server):
    with RemoteSandbox(server.url, timeout_s=0.5, retries=0) as sb:
        s = sb.session()
        r = s.run("import time\ntime.sleep(5)")
        assert not r.ok and r.timed_out and not r.infra_error
        assert _last_line(r) == "TimeoutError: execution exceeded 0.5 s"
        assert s.broken and "broken" in s.run("print(1)").output


def test_crash_is_not_an_infra_error(sandbox):
    s = sandbox.session()
    r = s.run("import os\nos._exit(7)")
    assert not r.ok and not r.infra_error and "exited with code 7" in _last_line(r)


def test_service_failures_are_retried(sandbox, server):
    server.failures[:] = ["500", "sandbox_error"]
    before = len(server.requests)
    r = sandbox.session().run("print('after retries')")
    assert r.ok and r.output == "after retries\n"
    assert len(server.requests) - before == 3


def test_cell_errors_are_not_retried(sandbox, server):
    before = len(server.requests)
    r = sandbox.session().run("raise ValueError('mine')")
    assert not r.ok and not r.infra_error
    assert len(server.requests) - before == 1


def test_exhausted_retries_give_an_infra_error(sandbox, server):
    server.failures[:] = ["500", "garbage", "sandbox_error"]
    before = len(server.requests)
    start = time.monotonic()
    r = sandbox.session().run("print(1)")
    assert not r.ok and r.infra_error and not r.timed_out
    assert r.output.startswith("SandboxError") and len(r.output.splitlines()) == 1
    assert len(server.requests) - before == 3 and time.monotonic() - start < 5


def test_unreachable_service(server):
    with RemoteSandbox("http://127.0.0.1:9", retries=1, backoff_s=0.01, request_timeout_s=2.0) as sb:
        start = time.monotonic()
        r = sb.session().run("print(1)")
    assert r.infra_error and not r.ok and time.monotonic() - start < 10


def test_requests_run_concurrently_and_in_order(sandbox):
    sessions = [sandbox.session() for _ in range(4)]
    start = time.monotonic()
    results = sandbox.run_many([(s, f"import time\ntime.sleep(0.5)\nprint({i})") for i, s in enumerate(sessions)])
    assert time.monotonic() - start < 1.6
    assert [r.output for r in results] == ["0\n", "1\n", "2\n", "3\n"]
    s = sessions[0]
    ordered = sandbox.run_many([(s, "a = 1"), (s, "a += 1"), (s, "print(a)")])
    assert ordered[2].output == "2\n"


def test_build_and_lifecycle(server):
    sb = build_sandbox("remote", url=server.url, timeout_s=2.0)
    assert isinstance(sb, RemoteSandbox)
    s = sb.session()
    s.close()
    assert s.closed and not s.run("1").ok
    sb.close()
    sb.close()
    with pytest.raises(RuntimeError):
        sb.session()


def test_output_is_valid_text_whatever_is_printed(sandbox):
    # The fake service, like one written in Python, passes raw bytes on as lone surrogates in its JSON.
    r = sandbox.session().run("import sys\nsys.stdout.buffer.write(b'ok \\xff\\n')")
    r.output.encode("utf-8")  # strict: no lone surrogates
    assert r.ok and r.output.startswith("ok "), r
