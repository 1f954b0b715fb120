"""`RemoteSandbox` against a small SandboxFusion-like server on 127.0.0.1 that behaves like the real one where it
matters (tests/helpers/fake_sandboxfusion.py says how)."""

import email.utils
import time

import pytest

from helpers.fake_sandboxfusion import serve_fake
from retool_trl.sandbox import RemoteSandbox, build_sandbox
from retool_trl.sandbox.remote import transport

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def server():
    yield from serve_fake()


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
    assert request["memory_limit_MB"] == 1024  # the service enforces the session's memory limit too
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
    """Four sessions' cells run at once: each cell reports when it slept, and all four sleeps overlap (a serial
    client would give four disjoint intervals). Read from the cells' own clocks, not a wall-time bound, so a loaded
    machine that starts jails slowly cannot fail it."""
    sessions = [sandbox.session() for _ in range(4)]
    code = "import time\nt0 = time.time()\ntime.sleep(1.0)\nprint({i}, t0, time.time())"
    results = sandbox.run_many([(s, code.format(i=i)) for i, s in enumerate(sessions)])
    spans = [r.output.split() for r in results]
    assert [int(span[0]) for span in spans] == [0, 1, 2, 3], [r.output for r in results]
    starts, ends = [float(span[1]) for span in spans], [float(span[2]) for span in spans]
    assert max(starts) < min(ends), (starts, ends)
    s = sessions[0]
    ordered = sandbox.run_many([(s, "a = 1"), (s, "a += 1"), (s, "print(a)")])
    assert ordered[2].output == "2\n"


def test_config_gives_the_remote_backend_the_local_limits(server):
    """A training config's memory limit and output bound reach the remote backend, as they reach the local one."""
    from types import SimpleNamespace

    from retool_trl.sandbox.factory import sandbox_from_config

    args = SimpleNamespace(
        sandbox_backend="remote",
        sandbox_url=server.url,
        sandbox_timeout_s=2.0,
        sandbox_memory_mb=768,
        max_interpreter_output_chars=2000,
        sandbox_max_concurrency=4,
        sandbox_memory_wait_s=45.0,
    )
    with sandbox_from_config(args) as sb:
        assert (sb.timeout_s, sb.memory_mb, sb.max_output_chars, sb.memory_wait_s) == (2.0, 768, 8000, 45.0)


def test_a_cell_that_kills_the_program_is_a_crash(sandbox):
    """The program that reports on the cell runs in the cell's reach (same uid): killing it is the cell's crash."""
    s = sandbox.session()
    r = s.run("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)")
    assert not r.ok and not r.infra_error and not r.timed_out
    assert _last_line(r) == "SystemError: the interpreter process exited with code -9" and s.broken


def test_the_report_fits_what_the_service_reads(server):
    """However large the output bound, the program's report stays under the ~200 KB the service reads (past it, the
    real service stalls the process and reports a time-out): characters that JSON escapes 6-fold included."""
    with RemoteSandbox(server.url, timeout_s=5.0, max_output_chars=100_000) as sb:
        s = sb.session()
        r = s.run("print('\\x01' * 1_000_000)")
        assert r.ok and not r.timed_out and not s.broken, r.output[-200:]
        assert r.output.startswith("\x01\x01") and r.output.endswith("\x01\n") and "characters elided" in r.output
        assert s.run("print('next')").output == "next\n"


def _post(server, code, **extra):
    import httpx

    body = {"code": code, "language": "python", "run_timeout": 2.0, **extra}
    return httpx.post(f"{server.url}/run_code", json=body, timeout=30).json()["run_result"]


def test_the_fake_service_behaves_like_sandboxfusion(server):
    """The fake keeps what the real SandboxFusion server was seen to do (so that the tests above hold the client to
    it): stack limit = memory limit, strict stdout encoding, strict decoding, the ~200 KB output stall."""
    stack = _post(server, "import resource\nprint(resource.getrlimit(resource.RLIMIT_STACK)[0])", memory_limit_MB=512)
    assert stack["stdout"] == f"{512 * 2**20}\n"
    surrogate = _post(server, "print(chr(0xD800))")
    assert surrogate["return_code"] == 1 and "UnicodeEncodeError" in surrogate["stderr"]
    raw = _post(server, "import sys\nsys.stdout.buffer.write(b'ok \\xff')")
    assert raw["return_code"] == 0 and raw["stdout"].startswith("[DecodeError] 'utf-8' codec can't decode byte 0xff")
    flood = _post(server, "print('x' * 1_000_000)", run_timeout=1.0)
    assert flood["status"] == "TimeLimitExceeded" and flood["return_code"] is None
    assert 100_000 < len(flood["stdout"]) < 250_000


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


@pytest.fixture
def delays(monkeypatch):
    """The waits between attempts, recorded instead of slept."""
    recorded = []
    monkeypatch.setattr(transport, "_sleep", recorded.append)
    return recorded


@pytest.mark.parametrize("failure", ["503", "429", "500", "drop", "garbage", "sandbox_error"])
def test_service_failures_get_retries_plus_one_attempts(server, delays, failure):
    server.failures[:] = [failure] * 10
    before = len(server.requests)
    with RemoteSandbox(server.url, retries=3, backoff_s=0.01) as sb:
        r = sb.session().run("print(1)")
    server.failures.clear()
    assert not r.ok and r.infra_error and not r.timed_out
    assert len(server.requests) - before == 4 and len(delays) == 3
    assert r.output.startswith("SandboxError: the code execution service failed") and "(after 4 attempts)" in r.output


def test_connection_refused_gets_retries_plus_one_attempts(delays):
    with RemoteSandbox("http://127.0.0.1:9", retries=2, backoff_s=0.01, request_timeout_s=2.0) as sb:
        r = sb.session().run("print(1)")
    assert r.infra_error and "ConnectError" in r.output and "(after 3 attempts)" in r.output
    assert len(delays) == 2


@pytest.mark.parametrize("status", ["400", "404", "422"])
def test_client_errors_are_not_retried(sandbox, server, delays, status):
    server.failures[:] = [status] * 3
    before = len(server.requests)
    r = sandbox.session().run("print(1)")
    server.failures.clear()
    assert not r.ok and r.infra_error and f"HTTP {status}" in r.output and "attempts" not in r.output
    assert len(server.requests) - before == 1 and delays == []


def test_retry_that_succeeds_gives_the_real_result(sandbox, server, delays):
    server.failures[:] = ["503"]
    s = sandbox.session()
    r = s.run("x = 5\nprint(x * 2)")
    assert r.ok and not r.infra_error and r.output == "10\n" and len(delays) == 1
    bad = s.run("print(x)\nraise KeyError('k')")  # the retried cell was kept for replay; a cell error stays its own
    assert not bad.ok and not bad.infra_error and bad.output.startswith("5\n") and "KeyError: 'k'" in bad.output


def test_backoff_grows_with_jitter(server, delays):
    server.failures[:] = ["500"] * 10
    with RemoteSandbox(server.url, retries=5, backoff_s=0.1) as sb:
        r = sb.session().run("print(1)")
    server.failures.clear()
    assert r.infra_error and len(delays) == 5
    # Attempt k waits backoff_s * 2**(k-1) plus a jitter of up to backoff_s.
    for k, delay in enumerate(delays):
        assert 0.1 * 2**k <= delay <= 0.1 * 2**k + 0.1 + 1e-9, delays
    assert delays == sorted(delays)
    assert [round(d - 0.1 * 2**k, 9) for k, d in enumerate(delays)] != [0.0] * 5  # the jitter is there


def test_backoff_is_capped(server, delays):
    server.failures[:] = ["500"] * 10
    with RemoteSandbox(server.url, retries=2, backoff_s=100.0) as sb:
        assert sb.session().run("print(1)").infra_error
    server.failures.clear()
    assert delays == [transport._MAX_WAIT_S] * 2


@pytest.mark.parametrize("status", ["429", "503"])
def test_retry_after_is_honoured_and_capped(server, delays, status):
    http_date = email.utils.formatdate(time.time() + 20, usegmt=True)
    server.failures[:] = [f"{status}:7", f"{status}:{http_date}", f"{status}:3600", f"{status}:soon"]
    with RemoteSandbox(server.url, retries=4, backoff_s=0.01) as sb:
        r = sb.session().run("print('served')")
    assert r.ok and r.output == "served\n"
    assert delays[0] == 7.0 and 18.0 <= delays[1] <= 20.0 and delays[2] == transport._MAX_WAIT_S
    assert delays[3] < 0.1  # an unreadable value falls back to the backoff


def test_retry_after_never_shortens_the_backoff(server, delays):
    server.failures[:] = ["503:0"]
    with RemoteSandbox(server.url, retries=1, backoff_s=0.5) as sb:
        assert sb.session().run("print(1)").ok
    assert 0.5 <= delays[0] <= 1.0


NOTEBOOK = [
    "x = 6 * 7",
    "x",
    "print(x)\n1/0",
    "undefined_name",
    "def f(:\n  pass",
    "import sys\nsys.exit(0)",
    "exit()",
    "import sys\nsys.exit(3)",
    "print('a' * 3000)",
    "None",
    "x + 1",
    "def g():\n    return 1/0\ng()",
    "import sys\nprint('err', file=sys.stderr)\nprint('out')",
    "raise KeyboardInterrupt",
    "assert x == 1, 'nope'",
    "y = [x] * 2\ny",
]


def test_the_model_sees_the_same_text_from_both_backends(server):
    """The same notebook through a real `LocalSandbox` and through the service: the model must not be able to tell
    them apart (output, cell names in tracebacks, ok), whatever the cells did before (a `sys.exit(0)` included)."""
    from retool_trl.sandbox import LocalSandbox

    server.failures.clear()
    with (
        LocalSandbox(num_workers=1, timeout_s=5.0, max_output_chars=500, preload=()) as local,
        RemoteSandbox(server.url, timeout_s=5.0, max_output_chars=500) as remote,
    ):
        a, b = local.session(), remote.session()
        for cell in NOTEBOOK:
            ours, theirs = a.run(cell), b.run(cell)
            assert (theirs.output, theirs.ok) == (ours.output, ours.ok), cell


# Sessions of cells on which the real SandboxFusion server and `LocalSandbox` were seen to differ, and their
# neighbours: each session runs in order, through both backends (1024 MB, 500 output characters, the time limit
# below: short where the time limit is what is tested, else long enough for a loaded machine).
PARITY_SESSIONS = {
    # No memory limit reached the service: 3 GB succeeded remotely. Local: MemoryError, and the session ends.
    "memory limit": ["x = 1", "big = bytearray(3 * 2**30)", "print(x)"],
    # With the service's memory limit its stack limit is as large: every thread reserves that much address space.
    "threads under the memory limit": [
        "import numpy as np\nprint(np.arange(4).sum())",
        "import threading\nt = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()",
    ],
    # The last cell sleeps past its own limit; the kept cells' run time (replayed, and the interpreter's start-up)
    # used to be added to the service's limit, so it ran to the end remotely.
    "time limit": ["import time\ntime.sleep(0.5)", "time.sleep(0.5)", "time.sleep(0.5)", "time.sleep(1.5)"],
    "time-out after partial output": ["import sys\nprint('partial', end='')\nsys.stdout.flush()\nwhile True: pass"],
    # The service's interpreter encodes stdout strictly and the service decodes it strictly.
    "unencodable text and undecodable bytes": [
        "print(chr(0xD800))",
        "print('a\\udcff b')",
        "import sys\nsys.stdout.buffer.write(b'ok \\xff\\n')",
        "import os\nos.write(1, b'native \\xfe\\n')",
        "print('after')",
    ],
    # The service stops reading at about 200 KB and reports a time-out.
    "large output": [
        "print('x' * 1_000_000)",
        "for i in range(100_000):\n    print(i)",
        "import os\nos.write(1, b'y' * 300_000)",
        "print('still here')",
    ],
    # Lone surrogates on every path out of a cell: a traceback, stderr, SystemExit, the source itself.
    "lone surrogates": [
        "raise ValueError(chr(0xDFFF))",
        "import sys\nprint(chr(0xDFFF), file=sys.stderr)",
        "import sys\nsys.exit(chr(0xDFFF))",
        "s = '\udfff'\nprint(len(s))",
        "print('ok')",
    ],
    "crashes": ["import os\nos._exit(7)"],
}
PARITY_TIMEOUT_S = {"time limit": 1.0, "time-out after partial output": 1.0}


@pytest.mark.parametrize("name", list(PARITY_SESSIONS))
def test_same_cells_same_results_as_local(server, name):
    """What the model sees (output, ok, timed_out, infra_error) is the same from `LocalSandbox` and from a service that
    behaves like SandboxFusion, cell by cell, for the cases where the real service was seen to differ; and every
    output is valid UTF-8 text, whatever the cell printed or raised."""
    from retool_trl.sandbox import LocalSandbox

    server.failures.clear()
    limits = dict(timeout_s=PARITY_TIMEOUT_S.get(name, 3.0), memory_mb=1024, max_output_chars=500)
    with (
        LocalSandbox(num_workers=1, preload=(), **limits) as local,
        RemoteSandbox(server.url, **limits) as remote,
    ):
        a, b = local.session(), remote.session()
        for cell in PARITY_SESSIONS[name]:
            ours, theirs = a.run(cell), b.run(cell)
            ours.output.encode("utf-8")
            theirs.output.encode("utf-8")
            assert (theirs.output, theirs.ok, theirs.timed_out, theirs.infra_error) == (
                ours.output,
                ours.ok,
                ours.timed_out,
                ours.infra_error,
            ), cell
            assert b.broken == a.broken, cell


def test_a_cell_that_kills_itself_is_not_the_sandboxs_failure(server):
    """Reward hacking: a cell that SIGKILLs its own process must not look like an outage, or the completion would
    be left unscored (no -1) every time the policy writes a wrong answer followed by that cell."""
    from retool_trl.rollout.cells import run_cells
    from retool_trl.rollout.rows import Row

    with RemoteSandbox(server.url, timeout_s=5.0) as sb:
        r = sb.session().run("print('wrong')\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
        assert not r.ok and not r.infra_error, r
        row = Row(prompt_ids=[1])
        (result,) = run_cells(sb, [(row, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")])
        assert not result.infra_error and not row.infra_failed and row.infra_errors == 0


@pytest.mark.parametrize("wait", [-1.0, float("nan")])
def test_a_memory_wait_that_is_no_duration_is_refused_in_one_line(wait):
    """A config's `sandbox_memory_wait_s` of -1 or NaN (a YAML `.nan`) would make every open give up at once."""
    from retool_trl.config import ReToolConfig

    with pytest.raises(ValueError, match="sandbox_memory_wait_s must be >= 0"):
        ReToolConfig(output_dir="unused", sandbox_memory_wait_s=wait)
