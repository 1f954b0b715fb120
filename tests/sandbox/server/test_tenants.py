"""Two tenants of one `retool-trl sandbox-server` on 127.0.0.1: what one tenant sends never changes what the other
gets. Each test stands for the condition "two server tenants": tenant A (hostile, or just careless) and tenant B (a
trainer with `RemoteSandbox`), each with its own token from the server's `--tokens-file`, by which the server tells
tenants apart (on one machine, all loopback addresses are one client). The truth each checks is outside the server's
own account: the text a cell printed, the wall-clock times the cells themselves read, a raw socket the server closes
or not."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from helpers.sandbox_server_helpers import ServerProcess
from retool_trl.sandbox import RemoteSandbox

pytest.importorskip("uvicorn", reason="the sandbox server needs the 'server' extra (starlette, uvicorn)")
pytest.importorskip("starlette", reason="the sandbox server needs the 'server' extra (starlette, uvicorn)")

pytestmark = pytest.mark.timeout(240)


TENANTS = ("a", "b", "c", "d", "e", "f")


def tenant(address: str, name: str | None = None) -> httpx.Client:
    """An HTTP client whose connections come from `address` (any 127.x.y.z reaches the server on 127.0.0.1), with
    tenant `name`'s token (default: the tenant named by the address's last digit, 2 -> "a")."""
    name = name or TENANTS[int(address.rsplit(".", 1)[1]) - 2]
    return httpx.Client(
        transport=httpx.HTTPTransport(local_address=address),
        timeout=60,
        headers={"Authorization": f"Bearer {name}-token"},
    )


def tokens_file(directory) -> str:
    """The `--tokens-file` of the tenants here (readable by its owner alone, as the server wants)."""
    path = directory / "tokens"
    path.write_text("".join(f"{name}-token {name}\n" for name in TENANTS))
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(
        "--workers", "2", "--max-limit-profiles", "4", "--max-timeout-s", "20",
        "--tokens-file", tokens_file(tmp_path_factory.mktemp("tenants")),
        # The sessions here hold a few MB each; the budget only has to admit what they reserve (up to 2 GB each).
        "--total-memory-mb", "16384",
    )  # fmt: skip
    yield srv
    srv.kill()


def test_out_of_range_limits_are_refused_naming_the_field_and_its_range(server):
    """Two server tenants: tenant A asks for limits no session can have (negative output, zero time, a string for a
    flag, a field that does not exist): each is a 400 that names the field and the range it must lie in, and nothing is
    opened."""
    a = tenant("127.0.0.2")
    cases = {
        "max_output_chars": {"max_output_chars": -5},
        "timeout_s": {"timeout_s": 0},
        "memory_mb": {"memory_mb": 10},
        "show_last_expression": {"show_last_expression": "yes"},
        "cpu_seconds": {"cpu_seconds": 3},
    }
    for field, body in cases.items():
        reply = a.post(f"{server.url}/sessions", json=body)
        assert reply.status_code == 400, (field, reply.text)
        assert field in reply.json()["detail"], reply.text
    too_long = a.post(f"{server.url}/sessions", json={"timeout_s": 1000}).json()["detail"]
    assert "timeout_s" in too_long and "20" in too_long  # the server's maximum is part of the range it names
    assert "max_output_chars" in a.post(f"{server.url}/sessions", json={"max_output_chars": 2}).json()["detail"]


def test_one_tenants_odd_limits_never_reach_another_tenants_sessions(server):
    """Two server tenants: tenant A fills the server's limit profiles with sessions of odd limits (tiny output, long
    time, much memory) and keeps them; tenant B, a trainer, then opens sessions: each gets exactly the limits it asked
    for, confirmed in the reply, and its right answer comes back whole (never cut to A's bound or failed as the model's
    error)."""
    a = tenant("127.0.0.2")
    odd = [
        {"max_output_chars": 64 + i, "timeout_s": 20, "memory_mb": 2048 + i, "show_last_expression": True}
        for i in range(3)
    ]
    held = []
    for limits in odd:
        reply = a.post(f"{server.url}/sessions", json=limits)
        if reply.status_code == 200:
            held.append(reply.json()["session_id"])
            a.post(f"{server.url}/sessions/{held[-1]}/run", json={"code": "x = 1"})
    try:
        asked = {"timeout_s": 5.0, "memory_mb": 1024, "max_output_chars": 4096, "show_last_expression": True}
        with RemoteSandbox(server.url, **asked, retries=0, token="b-token") as b:
            sessions = [b.session() for _ in range(2)]
            answer = "the answer is 123456, " + "as the working shows, " * 5
            code = f"print({answer!r})\nimport time; time.sleep(0.2)"
            results = b.run_many([(s, code) for s in sessions])
            assert [r.output for r in results] == [answer + "\n"] * 2  # longer than A's output bounds
            assert all(r.ok and not r.infra_error for r in results)
            slow = sessions[0].run("import time\ntime.sleep(30)")  # B's own 5 s, not A's 20 s
            assert slow.timed_out and slow.duration_s < 15, slow
            for s in sessions:
                s.close()
        confirmed = tenant("127.0.0.3").post(f"{server.url}/sessions", json=asked).json()
        assert confirmed["limits"] == asked
        tenant("127.0.0.3").delete(f"{server.url}/sessions/{confirmed['session_id']}")
    finally:
        for sid in held:
            a.delete(f"{server.url}/sessions/{sid}")


def test_a_trainer_that_closes_its_sessions_leaves_none_on_the_server(server):
    """Two server tenants: tenant B closes its sessions and its `RemoteSandbox` right after its last calls (the end
    of a rollout): none of its sessions stays live on the server, holding jails and the per-client bounds the tenant
    needs later, until the idle expiry."""
    before = httpx.get(f"{server.url}/health").json()["live_sessions"]
    with RemoteSandbox(server.url, timeout_s=5.0, retries=0, token="b-token") as b:
        sessions = [b.session() for _ in range(8)]
        assert all(r.ok for r in b.run_many([(s, "x = 1") for s in sessions]))
        for s in sessions:
            s.close()
    assert httpx.get(f"{server.url}/health").json()["live_sessions"] == before


def test_limit_profiles_share_the_nodes_cpu_slots(tmp_path):
    """Server tenants (three): sessions with three different limit sets each run two CPU-bound cells at once on a
    server with two CPU slots: at no moment do more than two compute (the cells' own clock readings say so), where a
    whole-node sandbox per limit set would run all six together."""
    spin = (
        "import time\nt0 = time.monotonic()\nc0 = time.process_time()\n"
        "while time.process_time() - c0 < 0.4:\n    pass\nprint(t0, time.monotonic())"
    )
    server = ServerProcess("--workers", "2", "--tokens-file", tokens_file(tmp_path))
    sessions = []
    for i in range(3):
        client = tenant(f"127.0.0.{4 + i}")
        limits = {"timeout_s": 15 + i, "memory_mb": 512, "max_output_chars": 4096}
        for _ in range(2):
            sessions.append((client, client.post(f"{server.url}/sessions", json=limits).json()["session_id"]))
    spans = []

    def run(client, sid):
        out = client.post(f"{server.url}/sessions/{sid}/run", json={"code": spin}).json()["results"][0]
        assert out["ok"], out
        spans.append(tuple(map(float, out["output"].split())))

    try:
        threads = [threading.Thread(target=run, args=pair) for pair in sessions]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        server.kill()
    assert len(spans) == 6
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans], key=lambda e: (e[0], e[1]))
    at_once = peak = 0
    for _, step in edges:
        at_once += step
        peak = max(peak, at_once)
    assert peak <= 2, spans


def test_limit_profiles_share_the_nodes_memory_budget(tmp_path):
    """Server tenants (three) opening sessions all at once, each with its own limit set beside the server's default,
    on a server whose budget holds 8 of their sessions (2048 MB, 256 MB each; a tenant may hold half of it): the
    reservations over every limit set and tenant never add up to more than the budget, and the 429 (`memory_full`)
    comes exactly when the next session would pass it: 8 of 12 opens succeed, a 64 MB session no longer fits, and
    one closed session makes room for exactly one more."""
    server = ServerProcess("--workers", "1", "--tokens-file", tokens_file(tmp_path), "--total-memory-mb", "2048")
    try:
        replies = []

        def open_one(i: int) -> None:
            client = tenant(f"127.0.0.{2 + i % 3}")
            replies.append(client.post(f"{server.url}/sessions", json={"timeout_s": 5 + i % 3, "memory_mb": 256}))

        threads = [threading.Thread(target=open_one, args=(i,)) for i in range(12)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        codes = sorted(r.status_code for r in replies)
        assert codes == [200] * 8 + [429] * 4, [r.text for r in replies]
        assert all(r.json()["error"] == "memory_full" for r in replies if r.status_code == 429)
        health = httpx.get(f"{server.url}/health").json()
        assert (health["reserved_memory_mb"], health["live_sessions"]) == (2048, 8), health
        owner = next(r for r in replies if r.status_code == 200)
        same = {"timeout_s": owner.json()["limits"]["timeout_s"]}  # a limit set in use: only memory can refuse
        small = tenant("127.0.0.2").post(f"{server.url}/sessions", json={**same, "memory_mb": 64})  # 2048 + 64
        assert small.status_code == 429 and small.json()["error"] == "memory_full", small.text
        for name in ("a", "b", "c"):  # close one session, whichever tenant holds it
            client = tenant("127.0.0.2", name)
            if client.delete(f"{server.url}/sessions/{owner.json()['session_id']}").status_code == 200:
                break
        assert httpx.get(f"{server.url}/health").json()["reserved_memory_mb"] == 1792
        assert client.post(f"{server.url}/sessions", json={**same, "memory_mb": 256}).status_code == 200
        small = client.post(f"{server.url}/sessions", json={**same, "memory_mb": 64})
        assert small.status_code == 429 and small.json()["error"] == "memory_full", small.text
    finally:
        server.kill()


def test_a_busy_session_is_refused_and_holds_no_slot():
    """Two server tenants: tenant A sends four requests at once to its one session while a cell of it runs: the extra
    ones are refused at once (409 + Retry-After), never queued on a running slot, so tenant B's cell runs meanwhile
    instead of getting 429 from a server whose slots A's queue took."""
    srv = ServerProcess("--workers", "2", "--max-concurrency", "2")
    try:
        a, b = tenant("127.0.0.2"), tenant("127.0.0.3")
        sid = a.post(f"{srv.url}/sessions", json={}).json()["session_id"]
        replies = []

        def call():
            replies.append(a.post(f"{srv.url}/sessions/{sid}/run", json={"code": "import time\ntime.sleep(2)"}))

        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
            time.sleep(0.05)
        time.sleep(0.3)
        other = b.post(f"{srv.url}/sessions", json={})
        assert other.status_code == 200
        ran = b.post(f"{srv.url}/sessions/{other.json()['session_id']}/run", json={"code": "print(7)"})
        assert ran.status_code == 200 and ran.json()["results"][0]["output"] == "7\n"
        for t in threads:
            t.join()
        codes = sorted(r.status_code for r in replies)
        assert codes == [200, 409, 409, 409], codes
        assert all(r.headers.get("Retry-After") for r in replies if r.status_code == 409)
    finally:
        srv.kill()


def test_bodies_headers_and_what_a_client_opens_are_bounded(tmp_path):
    """Two server tenants: one that sends a huge body, too many cells, its headers or body byte by byte, or opens
    sessions it never uses: each is refused or cut off by a bound (413, 400 naming `cells`, a closed socket, 408, 429
    for that client only), and fresh sessions it never used are gone soon, while another tenant still opens its own."""
    srv = ServerProcess(
        "--workers", "1", "--max-body-bytes", "100000", "--max-cells-per-request", "4", "--header-timeout-s", "1",
        "--body-timeout-s", "1", "--max-sessions-per-client", "3", "--fresh-idle-s", "3",
        "--tokens-file", tokens_file(tmp_path),
    )  # fmt: skip
    try:
        with socket.create_connection(("127.0.0.1", srv.port)) as slow:  # headers that never end
            slow.sendall(b"POST /sessions HTTP/1.1\r\nHost: x\r\n")
            slow.settimeout(10)
            started = time.monotonic()
            slow.recv(1024)  # returns once the server closes it (a socket left open raises TimeoutError)
            assert time.monotonic() - started < 8
        with socket.create_connection(("127.0.0.1", srv.port)) as slow:  # a body that never comes
            slow.sendall(b"POST /sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
            slow.sendall(b"Authorization: Bearer a-token\r\n")
            slow.sendall(b"Content-Length: 100\r\n\r\n{")
            slow.settimeout(10)
            assert slow.recv(1024).split(b" ")[1] == b"408"

        a, b = tenant("127.0.0.2"), tenant("127.0.0.3")
        sid = a.post(f"{srv.url}/sessions", json={}).json()["session_id"]
        huge = a.post(f"{srv.url}/sessions/{sid}/run", json={"code": "#" * 200_000})
        assert huge.status_code == 413
        many = a.post(f"{srv.url}/sessions/{sid}/run", json={"cells": ["1"] * 5})
        assert many.status_code == 400 and "cells" in many.json()["detail"] and "4" in many.json()["detail"]

        opened = [a.post(f"{srv.url}/sessions", json={}).status_code for _ in range(3)]
        assert opened == [200, 200, 429], opened  # the one above plus two: A's bound of 3
        assert b.post(f"{srv.url}/sessions", json={}).status_code == 200
        time.sleep(6)  # fresh sessions, never used, expire after 3 s (the expiry runs every 0.75 s)
        assert a.post(f"{srv.url}/sessions", json={}).status_code == 200
    finally:
        srv.kill()


def test_a_forwarded_for_header_does_not_make_a_new_client():
    """Two server tenants on one host: uvicorn trusts `X-Forwarded-For` from loopback peers by default, so a local
    tenant that wrote a new address in each request got a fresh per-client allowance each time. Past its bound it must
    be refused whatever the header says. A body nested past the JSON parser's depth is a 400, not a 500."""
    srv = ServerProcess("--workers", "1", "--max-sessions-per-client", "2")
    try:
        a = tenant("127.0.0.1")  # the address uvicorn trusts forwarded headers from by default
        codes = [
            a.post(f"{srv.url}/sessions", json={}, headers={"X-Forwarded-For": f"10.0.0.{i}"}).status_code
            for i in range(4)
        ]
        assert codes == [200, 200, 429, 429], codes
        deep = a.post(f"{srv.url}/sessions", content=b"[" * 200_000, headers={"Content-Type": "application/json"})
        assert deep.status_code == 400, deep.text
    finally:
        srv.kill()


class _Lowering(BaseHTTPRequestHandler):
    """A sessions server that confirms lower limits than asked (an older or a misconfigured server)."""

    def log_message(self, *args):
        pass

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._reply({"status": "ok", "sessions": 1})

    def do_POST(self):
        asked = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/sessions":
            limits = {**asked, "max_output_chars": 3}
            self._reply({"session_id": "s1", "limits": limits})
        else:
            self._reply({"results": [{"output": "the", "ok": True, "timed_out": False, "duration_s": 0.0}]})

    def do_DELETE(self):
        self._reply({"closed": True})


def test_remote_sandbox_refuses_a_session_served_below_what_it_asked():
    """Two server tenants, seen from tenant B: its `RemoteSandbox` against a server that confirms 3 output characters
    where B asked 4096 (as a server pinning another tenant's profile did): B refuses the session with one clear error
    naming the limit, instead of scoring a cut answer as wrong."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Lowering)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        with RemoteSandbox(url, max_output_chars=4096, retries=0) as sb:
            with pytest.raises(RuntimeError, match="max_output_chars"):
                sb.session().run("print('the answer is 123456')")
    finally:
        srv.shutdown()
        srv.server_close()
