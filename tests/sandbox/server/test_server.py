"""`retool-trl sandbox-server` as a real process on 127.0.0.1, checked with clients no one here wrote (the
`sandbox-fusion` package from PyPI, plain httpx) and with `RemoteSandbox`: SandboxFusion's `/run_code`, our stateful
sessions, the in-repo SandboxFusion fake giving the model the same text, the bound on running calls, a bearer token,
idle expiry, a client that leaves mid-call, a server killed mid-call, and a graceful stop that kills every jail."""

import re
import threading
import time

import httpx
import pytest

from helpers.fake_sandboxfusion import serve_fake
from helpers.sandbox_server_helpers import ServerProcess, alive, descendants
from retool_trl.rollout.cells import run_cells
from retool_trl.rollout.rows import Row
from retool_trl.sandbox import RemoteSandbox

pytest.importorskip("uvicorn", reason="the sandbox server needs the 'server' extra (starlette, uvicorn)")
pytest.importorskip("starlette", reason="the sandbox server needs the 'server' extra (starlette, uvicorn)")

pytestmark = pytest.mark.timeout(240)

TOKEN = "s3cret-token"

# Each session reserves its memory_mb (RemoteSandbox asks 1024) of the server's budget; the sessions here hold a few MB
# each, so the budget (and one client's share of it) is set to admit them all on any machine, as an operator who
# knows its cells would.
ROOMY = ("--total-memory-mb", "65536", "--max-memory-per-client-mb", "65536")


@pytest.fixture(scope="module")
def server():
    """The default server, as a user starts it (plus a low maximum time so that a clamp can be seen)."""
    srv = ServerProcess("--workers", "2", "--max-timeout-s", "20", "--max-limit-profiles", "16", *ROOMY)
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def small():
    """A small, guarded server: 2 calls at once, a token, sessions expire after 2 s idle."""
    srv = ServerProcess(
        "--workers", "2", "--max-concurrency", "2", "--idle-s", "2", *ROOMY, env={"RETOOL_SANDBOX_TOKEN": TOKEN}
    )
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def fake():
    yield from serve_fake()


# ------------------------------------------------------------------------------------ SandboxFusion's run_code


def test_sandbox_fusion_client_runs_its_code_here(server):
    """A verl/SkyRL user points the `sandbox-fusion` client (PyPI, 0.3.7) at our server: it gets the replies it
    parses, for success, an exception, stdin, a time-out and a language we do not serve."""
    sandbox_fusion = pytest.importorskip("sandbox_fusion")
    from sandbox_fusion import RunCodeRequest, RunStatus, run_code

    ok = run_code(RunCodeRequest(code="print(6 * 7)", language="python"), endpoint=server.url, max_attempts=1)
    assert ok.status == RunStatus.Success and ok.run_result.return_code == 0
    assert ok.run_result.stdout == "42\n" and ok.run_result.status.value == "Finished"

    bad = run_code(RunCodeRequest(code="print('a')\n1/0", language="python"), endpoint=server.url, max_attempts=1)
    assert bad.status == RunStatus.Failed and bad.run_result.return_code == 1
    assert bad.run_result.stdout == "a\n"
    assert bad.run_result.stderr.startswith("Traceback") and "ZeroDivisionError" in bad.run_result.stderr

    echo = run_code(
        RunCodeRequest(code="print(input()[::-1])", language="python", stdin="abc\n"),
        endpoint=server.url,
        max_attempts=1,
    )
    assert echo.run_result.stdout == "cba\n"

    slow = run_code(
        RunCodeRequest(code="import time\ntime.sleep(30)", language="python", run_timeout=1),
        endpoint=server.url,
        max_attempts=1,
    )
    assert slow.status == RunStatus.Failed and slow.run_result.status.value == "TimeLimitExceeded"
    assert slow.run_result.execution_time < 10

    summary = sandbox_fusion.summary_run_code_result(bad, sandbox_fusion.SummaryMapping())
    assert summary == RunStatus.Failed

    # Another of SandboxFusion's languages: its SandboxError reply, which the client raises on.
    with pytest.raises(Exception, match="python only"):
        run_code(RunCodeRequest(code="int main(){}", language="cpp"), endpoint=server.url, max_attempts=1)


def test_run_code_is_stateless_and_validated_like_sandbox_fusion(server):
    """verl sends `memory_limit_MB`, `files` and a fixed language name; a wrong body is answered as FastAPI would
    (422, `detail` naming the field); each call is a fresh jail."""
    url = f"{server.url}/run_code"
    first = httpx.post(url, json={"code": "x = 1\nprint(x)", "language": "python", "memory_limit_MB": 512}).json()
    assert first["status"] == "Success" and first["run_result"]["stdout"] == "1\n"
    second = httpx.post(url, json={"code": "print(x)", "language": "python"}).json()
    assert second["status"] == "Failed" and "NameError" in second["run_result"]["stderr"]
    files = {"data/in.txt": "aGVsbG8="}  # base64 of "hello"
    read = httpx.post(url, json={"code": "print(open('data/in.txt').read())", "language": "python", "files": files})
    assert read.json()["run_result"]["stdout"] == "hello\n"
    # The request's memory limit is the jail's (the kernel's rlimit/cgroup refuses the allocation), not advisory.
    big = {"code": "b = bytearray(600 << 20)\nprint(len(b) >> 20)", "language": "python"}
    small = httpx.post(url, json={**big, "memory_limit_MB": 256}, timeout=60).json()
    assert small["status"] == "Failed" and "MemoryError" in small["run_result"]["stderr"]
    roomy = httpx.post(url, json={**big, "memory_limit_MB": 2048}, timeout=60).json()
    assert roomy["status"] == "Success" and roomy["run_result"]["stdout"] == "600\n"
    missing = httpx.post(url, json={"language": "python"})
    assert missing.status_code == 422 and missing.json()["detail"][0]["loc"] == ["body", "code"]
    unknown = httpx.post(url, json={"code": "1", "language": "cobol"})
    assert unknown.status_code == 422 and unknown.json()["detail"][0]["loc"] == ["body", "language"]


# ------------------------------------------------------------------------------------------ stateful sessions


CELLS = [
    "x = 6 * 7\nprint(x)",
    "x + 1",
    "def f(n):\n    return n * x\nprint(f(2))",
    "1/0",
    "print('after the error', x)",
    "import sys\nprint('to stderr', file=sys.stderr)\nprint('é ✓')",
    "print('A' * 20000)",
    "raise ValueError('bad value')",
    "f(10)",
]


def test_native_sessions_and_replay_give_the_model_the_same_text(server, fake):
    """The model sees the same text, `ok` and `timed_out` whether its session lives in a jail on our server or is
    replayed on a SandboxFusion-like service; on ours, each cell ran once (no replay)."""
    before = server.metrics().get('retool_sandbox_events_total{event="sessions_opened"}', 0)
    cells_before = sum(v for k, v in server.metrics().items() if "cells_session" in k)
    limits = {"timeout_s": 5.0, "max_output_chars": 1000, "retries": 0}
    with RemoteSandbox(server.url, **limits) as ours, RemoteSandbox(fake.url, **limits) as theirs:
        a, b = ours.session(), theirs.session()
        for code in CELLS:
            mine, replayed = a.run(code), b.run(code)
            assert (mine.output, mine.ok, mine.timed_out) == (replayed.output, replayed.ok, replayed.timed_out), code
        assert ours._native == {server.url: True} and theirs._native == {fake.url: False}
        a.close()
    after = server.metrics()
    assert after['retool_sandbox_events_total{event="sessions_opened"}'] == before + 1
    assert sum(v for k, v in after.items() if "cells_session" in k) == cells_before + len(CELLS)


def test_many_concurrent_sessions_keep_their_own_state(server):
    """A rollout batch: 48 sessions at once, three calls each, each seeing only its own variables."""
    with RemoteSandbox(server.url, timeout_s=10.0, max_concurrency=16) as sb:
        sessions = [sb.session() for _ in range(48)]
        sb.run_many([(s, f"v = {i}") for i, s in enumerate(sessions)])
        sb.run_many([(s, "v = v * 3") for s in sessions])
        results = sb.run_many([(s, "print(v)") for s in sessions])
        assert [r.output for r in results] == [f"{3 * i}\n" for i in range(48)]
        for s in sessions:
            s.close()


def test_limits_above_the_servers_are_refused_and_run_code_is_capped(server):
    """A trainer asking for more time than the server allows is told so (400 naming the field and its range; its
    `RemoteSandbox` raises one clear error), never served other limits than it asked; a SandboxFusion caller's
    `run_timeout` is capped as SandboxFusion does."""
    reply = httpx.post(f"{server.url}/sessions", json={"timeout_s": 1000, "memory_mb": 512})
    assert reply.status_code == 400 and "timeout_s must be in (0, 20]" in reply.json()["detail"]
    ok = httpx.post(f"{server.url}/sessions", json={"timeout_s": 20, "memory_mb": 512}).json()
    assert ok["limits"]["timeout_s"] == 20.0 and ok["limits"]["memory_mb"] == 512
    assert httpx.delete(f"{server.url}/sessions/{ok['session_id']}").json() == {"closed": True}
    with RemoteSandbox(server.url, timeout_s=1000, retries=0) as sb:
        with pytest.raises(RuntimeError, match="timeout_s"):
            sb.session().run("1")
    capped = {"code": "print(1)", "language": "python", "run_timeout": 1000}
    assert httpx.post(f"{server.url}/run_code", json=capped, timeout=60).json()["run_result"]["stdout"] == "1\n"


def test_a_client_that_leaves_mid_call_costs_nothing(server):
    """A trainer that times out and drops its connection mid-cell: the server finishes the cell, frees the slot,
    and the session (its state) is still there for the next call."""
    sid = httpx.post(f"{server.url}/sessions", json={}).json()["session_id"]
    run = f"{server.url}/sessions/{sid}/run"
    httpx.post(run, json={"code": "k = 5"})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(run, json={"code": "import time\ntime.sleep(1.5)\nk += 1"}, timeout=0.3)
    deadline = time.monotonic() + 30
    while httpx.get(f"{server.url}/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{server.url}/health").json()["running"] == 0
    assert httpx.post(run, json={"code": "k"}).json()["results"][0]["output"] == "6\n"
    httpx.delete(f"{server.url}/sessions/{sid}")


# ---------------------------------------------------------------------------------------- bounds and guards


def test_a_burst_over_the_bound_gets_429_and_nothing_is_lost(small):
    """Twelve cells at once on a server that runs two: the rest are refused at once with 429 + Retry-After (not
    queued), and `RemoteSandbox`, which retries them, gets every result."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    sleepy = {"code": "import time\ntime.sleep(0.5)\nprint('done')", "language": "python"}
    replies = []

    def post():
        replies.append(httpx.post(f"{small.url}/run_code", json=sleepy, headers=auth, timeout=30))

    threads = [threading.Thread(target=post) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [r for r in replies if r.status_code == 429]
    assert refused and all(r.headers["Retry-After"] for r in refused)
    assert all(r.json()["run_result"]["stdout"] == "done\n" for r in replies if r.status_code == 200)

    with RemoteSandbox(small.url, token=TOKEN, max_concurrency=12, retries=20, backoff_s=0.05) as sb:
        sessions = [sb.session() for _ in range(12)]
        results = sb.run_many([(s, f"import time\ntime.sleep(0.3)\nprint({i})") for i, s in enumerate(sessions)])
    assert [r.output for r in results] == [f"{i}\n" for i in range(12)]
    assert small.metrics(TOKEN)['retool_sandbox_events_total{event="rejected_busy"}'] >= len(refused)


def test_the_token_is_required_when_set(small):
    """A server started with a token: no call without it (401), /health still answers (for probes)."""
    assert httpx.post(f"{small.url}/run_code", json={"code": "1", "language": "python"}).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.post(f"{small.url}/sessions", json={}, headers=wrong).status_code == 401
    assert httpx.get(f"{small.url}/metrics").status_code == 401
    assert httpx.get(f"{small.url}/health").status_code == 200
    with RemoteSandbox(small.url, retries=0) as sb:  # no token: the cell is an infrastructure error, said so
        r = sb.session().run("1")
    assert r.infra_error and "401" in r.output


def test_idle_sessions_expire(small):
    """A session left open by a crashed trainer is closed after the server's idle time; using it afterwards is an
    infrastructure error (the rollout retries), not the snippet's."""
    with RemoteSandbox(small.url, token=TOKEN, retries=0) as sb:
        s = sb.session()
        assert s.run("z = 1").ok
        deadline = time.monotonic() + 30
        while small.metrics(TOKEN).get("retool_sandbox_live_sessions", 0) and time.monotonic() < deadline:
            time.sleep(0.5)
        r = s.run("z")
    assert r.infra_error and not r.ok and "404" in r.output


# -------------------------------------------------------------------------------------------------- faults


def test_a_server_killed_mid_call_makes_infra_errors_that_the_rollout_retries():
    """Two servers; one dies (SIGKILL of its whole process group) while cells run on it. Its completions get
    infra errors, the rollout retries them on a fresh session (pinned to the live server) with their earlier
    cells, and every completion ends with the right output; with no server left, completions are marked failed."""
    a, b = ServerProcess("--workers", "2", *ROOMY), ServerProcess("--workers", "2", *ROOMY)
    try:
        with RemoteSandbox([a.url, b.url], timeout_s=10.0, retries=1, backoff_s=0.05) as sb:
            rows = [Row(prompt_ids=[1]) for _ in range(16)]  # all on one server: a 2**-15 chance
            run_cells(sb, [(row, f"x = {i}") for i, row in enumerate(rows)])
            for i, row in enumerate(rows):
                row.cells.append(f"x = {i}")
            assert {row.session.server for row in rows} == {a.url, b.url}  # both servers took sessions
            on_a = [i for i, row in enumerate(rows) if row.session.server == a.url]
            killer = threading.Timer(1.0, a.kill)
            killer.start()
            code = "import time\ntime.sleep(3)\nprint(x * 10)"
            results = run_cells(sb, [(row, code) for row in rows])
            killer.join()
            assert [r.output for r in results] == [f"{10 * i}\n" for i in range(16)]
            assert not any(row.infra_failed for row in rows)
            assert all(rows[i].session.server == b.url for i in on_a)
        with RemoteSandbox(a.url, retries=1, backoff_s=0.05) as gone:
            row = Row(prompt_ids=[1])
            (r,) = run_cells(gone, [(row, "print(1)")])
        assert r.infra_error and not r.ok and row.infra_failed
    finally:
        a.kill()
        b.kill()


def test_graceful_stop_finishes_running_calls_and_kills_every_jail():
    """SIGTERM (a pod being stopped): the cell running then finishes and is answered, the server exits cleanly, and no
    process it started (jails, zygotes) is left."""
    srv = ServerProcess("--workers", "2")
    try:
        sessions = [httpx.post(f"{srv.url}/sessions", json={}).json()["session_id"] for _ in range(3)]
        for sid in sessions:
            httpx.post(f"{srv.url}/sessions/{sid}/run", json={"code": "y = list(range(1000))"})
        tree = descendants(srv.proc.pid)
        assert tree  # the jails and their zygote are there
        replies = []
        call = threading.Thread(
            target=lambda: replies.append(
                httpx.post(
                    f"{srv.url}/sessions/{sessions[0]}/run",
                    json={"code": "import time\ntime.sleep(2)\nprint(len(y))"},
                    timeout=60,
                )
            )
        )
        call.start()
        time.sleep(0.7)
        out = srv.terminate()
        call.join()
        # uvicorn re-raises the SIGTERM once it has shut down cleanly (the exit status a supervisor expects).
        assert srv.proc.returncode in (0, -15), out
        assert "every jail closed" in out
        assert replies[0].json()["results"][0]["output"] == "1000\n"
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in tree if alive(pid)]
        assert "sandbox isolation:" in out
        # An operator learns at the start how many sessions its memory budget holds (each reserves its memory_mb).
        line = next(x for x in out.splitlines() if "memory budget" in x)
        mb, sessions = (int(n) for n in re.search(r"budget (\d+) MB: at most (\d+) live sessions", line).groups())
        assert sessions == mb // 1024 and sessions >= 1, line
    finally:
        srv.kill()


def test_config_takes_one_url_or_several():
    """`sandbox_url` from a YAML list or a comma-separated command-line value reaches the remote backend as
    several servers, and sessions spread over them (each pinned to one)."""
    from retool_trl import ReToolConfig
    from retool_trl.sandbox.factory import sandbox_from_config

    urls = ["http://10.0.0.1:8080", "http://10.0.0.2:8080/"]
    for value in (urls, ",".join(urls)):
        args = ReToolConfig(output_dir="/tmp/unused", sandbox_backend="remote", sandbox_url=value, report_to="none")
        sandbox = sandbox_from_config(args)
        inner = getattr(sandbox, "sandbox", sandbox)
        assert inner.urls == ["http://10.0.0.1:8080", "http://10.0.0.2:8080"]
        assert {inner.session().server for _ in range(64)} == set(inner.urls)
        sandbox.close()


def test_bad_settings_and_an_unsafe_host_are_one_line_errors():
    """A user's wrong setting, or a root host where no isolation works, ends the command with exit status 2 and
    one line naming the problem, before any port opens."""
    import os
    import subprocess
    import sys

    command = [sys.executable, "-m", "retool_trl", "sandbox-server", "--port", "9"]
    bad = subprocess.run([*command, "--timeout-s", "100"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "max_timeout_s" in bad.stderr
    if os.geteuid() != 0:
        pytest.skip("the root-without-isolation refusal needs root")
    unsafe = subprocess.run([*command, "--isolation", "none"], capture_output=True, text=True, timeout=120)
    assert unsafe.returncode == 2 and "cannot start here" in unsafe.stderr
    assert len(unsafe.stderr.strip().splitlines()) == 1


def test_a_token_on_the_command_line_is_refused_where_cells_can_read_it(tmp_path):
    """On a level without a private /proc (`landlock`, as in a default container), a cell reads every command line:
    a token given with --token is refused in one line before the port opens; the variable and --token-file work."""
    import subprocess
    import sys

    from retool_trl.sandbox import LocalSandbox
    from retool_trl.sandbox.host.zygote import SandboxStartError

    try:
        with LocalSandbox(isolation="landlock", num_workers=1, spares=0) as probe:
            probe.isolation_report()
    except SandboxStartError as exc:
        pytest.skip(f"the landlock level does not run here ({str(exc).rsplit(': ', 1)[-1][:80]})")
    command = [sys.executable, "-m", "retool_trl", "sandbox-server", "--port", "9", "--isolation", "landlock"]
    refused = subprocess.run([*command, "--token", "s3cret"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert "RETOOL_SANDBOX_TOKEN" in refused.stderr and "--token-file" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and "s3cret" not in refused.stderr
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file\n")
    srv = ServerProcess("--isolation", "landlock", "--token-file", str(token_file))
    try:
        assert httpx.get(f"{srv.url}/metrics", timeout=10).status_code == 401
        ok = httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer from-a-file"}, timeout=10)
        assert ok.status_code == 200
    finally:
        srv.kill()


def test_the_session_bound_refuses_with_429_and_frees_on_close():
    """A server at its live-session bound refuses one more with 429 + Retry-After (the client backs off) and takes
    new ones again once a session is closed: memory stays bounded whatever the trainers ask."""
    from starlette.testclient import TestClient

    from retool_trl.sandbox.server import ServerConfig, create_app

    app = create_app(ServerConfig(max_sessions=2, workers=1))
    client = TestClient(app)  # no lifespan: no jail starts, sessions fork at their first cell
    first, second = (client.post("/sessions", json={}) for _ in range(2))
    assert first.status_code == second.status_code == 200
    refused = client.post("/sessions", json={})
    assert refused.status_code == 429 and refused.headers["Retry-After"]
    assert client.delete(f"/sessions/{first.json()['session_id']}").json() == {"closed": True}
    assert client.post("/sessions", json={}).status_code == 200
    assert client.delete(f"/sessions/{first.json()['session_id']}").status_code == 404
    app.state.table.close()


def test_native_sessions_are_refused_clearly_on_a_plain_sandbox_fusion(fake):
    """`sessions="native"` pointed at a plain SandboxFusion: one clear error naming the fix, not a replay."""
    with RemoteSandbox(fake.url, sessions="native", retries=0) as sb:
        with pytest.raises(RuntimeError, match="offers no sessions"):
            sb.session().run("1")


@pytest.mark.slow
def test_the_server_benchmark_reports_its_keys():
    """`scripts/bench_sandbox.py --server --json` at tiny sizes: the keys DESIGN.md names, with sane values."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "scripts" / "bench_sandbox.py"
    tiny = ["--server-runs", "1", "--server-calls", "3", "--server-sessions", "1", "--server-work", "20000"]
    done = subprocess.run(
        [sys.executable, str(script), "--server", *tiny, "--json"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("server_p50_ms", "server_p99_ms", "server_cells_per_s", "session_call_cost_ratio"):
        assert row[key] > 0, key
    assert len(row["session_call_ms_by_index"]) == len(row["replay_call_ms_by_index"]) == 8
