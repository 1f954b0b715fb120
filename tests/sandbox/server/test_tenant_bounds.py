"""Two tenants of one `retool-trl sandbox-server`, and what tells them apart: a tenant's memory never makes another's
cell fail as that model's own error (each live session reserves its `memory_mb` of the server's budget, and a cell
killed all the same for the sandbox's full memory is an infrastructure error), and the per-client bounds are kept per
tenant (its token from `--tokens-file`) or per machine (every loopback address one client, an IPv6 client its /64),
never per address a client may pick for free. Each test's docstring names the condition it stands for."""

import os
import subprocess
import sys

import httpx
import pytest

from helpers.sandbox_server_helpers import ServerProcess
from retool_trl.sandbox import RemoteSandbox

pytest.importorskip("uvicorn", reason="the sandbox server needs the 'server' extra (starlette, uvicorn)")
pytest.importorskip("starlette", reason="the sandbox server needs the 'server' extra (starlette, uvicorn)")

pytestmark = pytest.mark.timeout(240)

PARK = "block = bytes(range(256)) * (12 << 12)\nprint(len(block) >> 20)"  # 12 MB, resident (not lazy zero pages)
BIG = "import os\n{name} = bytearray(os.urandom(1 << 20)) * 90\nprint(len({name}) >> 20)"  # 90 MB, resident


def tenant(address: str, token: str | None = None) -> httpx.Client:
    """An HTTP client whose connections come from `address` (any 127.x.y.z reaches the server on 127.0.0.1)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=60, headers=headers)


def _needs_memory_cgroup(url: str) -> None:
    missing = httpx.get(f"{url}/health").json()["missing"]
    if any(m.startswith(("cgroups", "memory cgroup", "memory.limit_in_bytes")) for m in missing):
        named = next(m for m in missing if m.startswith(("cgroups", "memory cgroup", "memory.limit_in_bytes")))
        pytest.skip(f"needs a writable memory cgroup (the sandbox-wide memory bound); missing here: {named[:120]}")


def test_one_tenants_parked_memory_never_fails_anothers_cell_as_its_own():
    """Two server tenants on a root host with a writable memory cgroup (the sandbox-wide memory bound in force):
    tenant A parks ten sessions holding 12 MB each on the server's default limit set; tenant B then runs two 90 MB
    cells, together well within its own `memory_mb`, on the same limit set. B's cells run and print their answers, or
    at worst are infrastructure errors (retried): never a `MemoryError` scored as B's model's own mistake."""
    srv = ServerProcess(
        "--workers", "1", "--memory-mb", "512", "--total-memory-mb", "6144", "--max-limit-profiles", "24",
        "--fresh-idle-s", "120", "--max-memory-per-client-mb", "6144",
    )  # fmt: skip
    a, b = tenant("127.0.0.2"), tenant("127.0.0.3")
    try:
        _needs_memory_cgroup(srv.url)
        parked = []
        for _ in range(10):
            sid = a.post(f"{srv.url}/sessions", json={}).json()["session_id"]
            out = a.post(f"{srv.url}/sessions/{sid}/run", json={"code": PARK}).json()["results"][0]
            assert out["output"] == "12\n", out  # A's own cells stay within their bound
            parked.append(sid)
        sid = b.post(f"{srv.url}/sessions", json={}).json()["session_id"]
        # The last cell reads B's blocks again: a kill just after an earlier cell's answer shows there.
        cells = [BIG.format(name="one"), BIG.format(name="two"), "print((len(one) + len(two)) >> 21)"]
        results = b.post(f"{srv.url}/sessions/{sid}/run", json={"cells": cells}).json()["results"]
        for result in results:
            assert result["infra_error"] or (result["ok"] and result["output"] == "90\n"), results
    finally:
        srv.kill()


def test_the_sandboxs_full_memory_is_an_infrastructure_error_where_memory_is_reserved():
    """The server's sandbox (every session's `memory_mb` reserved out of the budget) on a root host with a memory
    cgroup, its bound reached anyway (here overbooked on purpose: two 180 MB cells in a 300 MB bound, each within its
    own 400 MB): the session killed for the sandbox's full memory stayed within its own bound, so its result is an
    infrastructure error (retried), never a `MemoryError` scored as the model's."""
    from retool_trl.sandbox import LocalSandbox

    allocate = "import os\nblock = bytearray(os.urandom(1 << 20)) * 180\nprint(len(block) >> 20)"
    with LocalSandbox(num_workers=2, timeout_s=20.0, memory_mb=400, total_memory_mb=300, preload=(), spares=0) as sb:
        sb.memory_reserved = True  # as the server builds its sandboxes
        report = sb.isolation_report()
        if not report["memory_cgroup"] or not report["jail_per_session"]:
            pytest.skip(f"needs per-session jails and a memory cgroup (level here: {report['isolation']})")
        a, b = sb.session(), sb.session()
        results = [a.run(allocate), b.run(allocate)]
        results += [a.run("print('later')"), b.run("print('later')")]  # a session killed between calls says so here
    failed = [r for r in results if not r.ok]
    assert failed, results  # 360 MB do not fit in 300: one of them was killed
    for r in failed:
        assert r.infra_error and "MemoryError" not in r.output, r


def test_a_session_whose_memory_does_not_fit_the_budget_is_refused_at_open():
    """Server tenants on any host: each live session reserves its `memory_mb` of the server's memory budget when it
    opens. Past the budget, one more is answered 429 (with `Retry-After`, one line naming the memory), before it
    could crowd the sessions already open; closing one makes room again; a session asking more than the whole budget
    is a 400 naming `memory_mb`."""
    srv = ServerProcess(
        "--workers", "1", "--memory-mb", "256", "--total-memory-mb", "1024", "--max-memory-per-client-mb", "1024",
    )  # fmt: skip
    try:
        opened = [httpx.post(f"{srv.url}/sessions", json={}) for _ in range(5)]
        assert [r.status_code for r in opened] == [200, 200, 200, 200, 429], [r.text for r in opened]
        refused = opened[-1]
        assert refused.headers.get("Retry-After") and refused.json()["error"] == "memory_full"
        detail = refused.json()["detail"]
        assert "memory" in detail and "1024" in detail and "\n" not in detail, detail
        assert httpx.get(f"{srv.url}/health").json()["reserved_memory_mb"] == 1024
        httpx.delete(f"{srv.url}/sessions/{opened[0].json()['session_id']}")
        assert httpx.post(f"{srv.url}/sessions", json={}).status_code == 200
        huge = httpx.post(f"{srv.url}/sessions", json={"memory_mb": 2048})
        assert huge.status_code == 400 and "memory_mb" in huge.json()["detail"], huge.text
    finally:
        srv.kill()


def test_every_loopback_address_is_one_client():
    """Two server tenants on the server's own machine, one of which connects from 127.0.0.2 and 127.0.0.3 (any
    127.x.y.z reaches a server on loopback): its addresses count as one client, so it cannot take more than one
    client's sessions or limit sets, and the other tenant still gets the limit set it needs."""
    srv = ServerProcess("--workers", "1", "--max-sessions-per-client", "2", "--max-profiles-per-client", "2")
    try:
        first, second = tenant("127.0.0.2"), tenant("127.0.0.3")
        assert first.post(f"{srv.url}/sessions", json={}).status_code == 200
        assert first.post(f"{srv.url}/sessions", json={"timeout_s": 3}).status_code == 200
        assert second.post(f"{srv.url}/sessions", json={"timeout_s": 4}).status_code == 429  # 3rd session
    finally:
        srv.kill()
    srv = ServerProcess("--workers", "1", "--max-profiles-per-client", "2")
    try:
        first, second = tenant("127.0.0.2"), tenant("127.0.0.3")
        assert first.post(f"{srv.url}/sessions", json={"timeout_s": 3}).status_code == 200
        assert first.post(f"{srv.url}/sessions", json={"timeout_s": 4}).status_code == 200
        refused = second.post(f"{srv.url}/sessions", json={"timeout_s": 5})  # the loopback client's third set
        assert refused.status_code == 429 and "limit sets" in refused.json()["detail"], refused.text
    finally:
        srv.kill()


def _tokens_file(tmp_path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / f"tokens-{len(list(tmp_path.iterdir()))}"
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


def test_two_tokens_from_one_address_are_two_tenants(tmp_path):
    """Two server tenants behind one address (the same machine, or a NAT or proxy in front of the server), each with
    its token from `--tokens-file`: the per-client bounds are kept per tenant, so one tenant at its bound leaves the
    other its own, whatever addresses either connects from; a call without a known token is a 401; `RemoteSandbox`
    sends its tenant's token as it sends the server's token."""
    tokens = _tokens_file(tmp_path, "# token tenant\nalice-token alice\n\nbob-token bob\n")
    srv = ServerProcess("--workers", "1", "--tokens-file", tokens, "--max-sessions-per-client", "2")
    try:
        alice = [tenant("127.0.0.1", "alice-token"), tenant("127.0.0.2", "alice-token")]
        bob = tenant("127.0.0.1", "bob-token")
        assert [c.post(f"{srv.url}/sessions", json={}).status_code for c in alice] == [200, 200]
        assert alice[0].post(f"{srv.url}/sessions", json={}).status_code == 429  # alice at her bound
        assert alice[1].post(f"{srv.url}/sessions", json={}).status_code == 429  # from another address too
        assert [bob.post(f"{srv.url}/sessions", json={}).status_code for _ in range(2)] == [200, 200]
        assert tenant("127.0.0.1", "carol-token").post(f"{srv.url}/sessions", json={}).status_code == 401
        assert tenant("127.0.0.1").post(f"{srv.url}/sessions", json={}).status_code == 401
        assert httpx.get(f"{srv.url}/health").status_code == 200  # no token needed for /health
    finally:
        srv.kill()
    srv = ServerProcess("--workers", "1", "--tokens-file", tokens)
    try:
        with RemoteSandbox(srv.url, token="bob-token", retries=0) as sb:
            assert sb.session().run("print(6 * 7)").output == "42\n"
    finally:
        srv.kill()


def test_a_tokens_file_that_cannot_be_used_is_refused_in_one_line(tmp_path):
    """An operator starting the server with a tokens file that is malformed, readable by other users (whose cells
    could read it where the filesystem is not private), or given beside `--token`: the server does not start, and
    says in one line what to fix, without printing a token."""
    command = [sys.executable, "-m", "retool_trl", "sandbox-server", "--port", "9", "--tokens-file"]
    cases = {
        "TOKEN TENANT": _tokens_file(tmp_path, "alice-token alice extra\n"),
        "chmod 600": _tokens_file(tmp_path, "alice-token alice\n", 0o644),
    }
    for fix, path in cases.items():
        done = subprocess.run([*command, path], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert fix in done.stderr and "alice-token" not in done.stderr, done.stderr
    (tmp_path / "token").write_text("one-token\n")
    good = _tokens_file(tmp_path, "alice-token alice\n")
    both = subprocess.run([*command, good, "--token-file", str(tmp_path / "token")], capture_output=True, text=True)
    assert both.returncode == 2 and "--tokens-file" in both.stderr and len(both.stderr.strip().splitlines()) == 1


def test_an_ipv6_client_is_its_64_and_loopback_is_one_client():
    """Clients told apart by address on a dual-stack server (no tokens): an IPv6 host picks any address of its /64
    for free, so every address of one /64 is one client and another /64 another; `::1` and all of 127.0.0.0/8 are the
    one loopback client; an IPv4 peer seen on an IPv6 socket is the same client as over IPv4. (The keying function
    itself: this machine may not bind IPv6.)"""
    from retool_trl.sandbox.server.clients import address_key

    assert address_key("2001:db8:1:2::1") == address_key("2001:db8:1:2:ffff:ffff:ffff:fffe")
    assert address_key("2001:db8:1:2::1") != address_key("2001:db8:1:3::1")
    assert address_key("::1") == address_key("127.0.0.1") == address_key("127.9.8.7")
    assert address_key("::ffff:10.1.2.3") == address_key("10.1.2.3") != address_key("10.1.2.4")
    assert address_key("fe80::1%eth0") == address_key("fe80::2")
