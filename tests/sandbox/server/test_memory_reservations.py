"""The sandbox server's memory reservations as a trainer and its tenants meet them: a trainer whose rollouts hold
more sessions than the budget admits waits for room instead of failing its cells; a reservation is given back
whatever fails between taking it and giving it back; one tenant can neither use another's session nor hold the whole
budget; a server whose default budget holds no session refuses to start. Each test's docstring names the condition
it stands for."""

import threading
import time

import httpx
import pytest

from helpers.sandbox_server_helpers import ServerProcess
from retool_trl.sandbox import RemoteSandbox

pytest.importorskip("uvicorn", reason="the sandbox server needs the 'server' extra (starlette, uvicorn)")
pytest.importorskip("starlette", reason="the sandbox server needs the 'server' extra (starlette, uvicorn)")

pytestmark = pytest.mark.timeout(240)


def _table(**settings):
    from retool_trl.sandbox.server.config import ServerConfig
    from retool_trl.sandbox.server.table import SessionTable

    return SessionTable(ServerConfig(**{"memory_mb": 256, "total_memory_mb": 1024, **settings}))


def test_a_trainer_with_more_rollouts_than_the_budget_holds_waits_for_room():
    """A trainer (`RemoteSandbox`) on a server whose memory budget holds 2 of its sessions, with 4 rollouts in
    flight, each holding its session for its whole multi-turn rollout (here: 6 s after its cell, longer than the
    few seconds of retries a 429 gets): every cell runs and prints its answer, none is an infrastructure error; the
    later two open only once earlier ones closed. Past `memory_wait_s` with the budget still full, the cell is an
    infrastructure error whose one line names the server's `--total-memory-mb`."""
    srv = ServerProcess(
        "--workers", "1", "--memory-mb", "256", "--total-memory-mb", "512", "--max-memory-per-client-mb", "512",
    )  # fmt: skip
    hold_s = 6.0
    try:
        with RemoteSandbox(srv.url, memory_mb=256, timeout_s=10.0) as sb:
            answered, closed = {}, []

            def rollout(i: int) -> None:
                session = sb.session()
                result = session.run(f"print({i} * 7)")
                answered[i] = (result, time.monotonic())
                time.sleep(hold_s)
                session.close()
                closed.append(time.monotonic())

            threads = [threading.Thread(target=rollout, args=(i,)) for i in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)
            for i, (result, _) in answered.items():
                assert result.ok and not result.infra_error and result.output == f"{i * 7}\n", result
            assert len(answered) == 4, answered
            times = sorted(when for _, when in answered.values())
            assert times[2] >= min(closed[:2]) - 0.5, (times, closed)  # the third ran once a session closed
        with RemoteSandbox(srv.url, memory_mb=256, memory_wait_s=1.0) as sb:
            held = [sb.session(), sb.session()]
            assert all(s.run("print(1)").ok for s in held)
            late = sb.session().run("print(2)")
            assert late.infra_error and "--total-memory-mb" in late.output and "\n" not in late.output.strip(), late
    finally:
        srv.kill()


def test_a_reservation_is_given_back_whatever_fails(monkeypatch):
    """A server whose sandbox fails in a way no bound foresaw (building a limit set's sandbox raises, closing a
    session's jail raises, one of several idle sessions fails to close): every reservation taken is given back, so
    the budget never shrinks for good (else the server would answer 429 forever)."""
    from starlette.testclient import TestClient

    from retool_trl.sandbox.server.app import create_app
    from retool_trl.sandbox.server.table import SessionTable

    table = _table(idle_s=0.01, fresh_idle_s=0.01, max_memory_per_client_mb=1024)
    try:
        broken = RuntimeError("the sandbox cannot be built")
        real_take = table.take_profile

        def fail(*args, **kwargs):
            raise broken

        monkeypatch.setattr(table, "take_profile", fail)
        with pytest.raises(RuntimeError):
            table.open({"timeout_s": 5.0, "memory_mb": 256, "max_output_chars": 64, "show_last_expression": True}, "x")
        assert table.reserved_mb == 0
        client = TestClient(create_app(table.config, table))  # no lifespan: no jail starts
        with pytest.raises(RuntimeError):
            client.post("/run_code", json={"code": "print(1)", "language": "python"})
        assert (table.reserved_mb, table.running) == (0, 0)
        monkeypatch.setattr(table, "take_profile", real_take)

        limits = {"timeout_s": 5.0, "memory_mb": 256, "max_output_chars": 64, "show_last_expression": True}
        sid, _ = table.open(limits, "x")
        monkeypatch.setattr(table._sessions[sid].session, "close", fail)
        with pytest.raises(RuntimeError):
            table.close_session(sid)
        assert table.reserved_mb == 0

        ids = [table.open(limits, "x")[0] for _ in range(3)]
        monkeypatch.setattr(table._sessions[ids[0]].session, "close", fail)
        time.sleep(0.05)
        assert table.expire() == 3
        assert table.reserved_mb == 0 and not table._reserved_by
    finally:
        monkeypatch.undo()
        SessionTable.close(table)


def test_a_tenants_token_opens_its_own_sessions_only(tmp_path):
    """Two server tenants, each with its token from `--tokens-file`: tenant B, given (or guessing) tenant A's
    session id, can neither run a cell in it nor close it (both a 404 `unknown_session`, as for a session that does
    not exist), and A's session goes on with its state."""
    tokens = tmp_path / "tokens"
    tokens.write_text("alice-token alice\nbob-token bob\n")
    tokens.chmod(0o600)
    srv = ServerProcess("--workers", "1", "--tokens-file", str(tokens))
    try:
        alice = httpx.Client(timeout=60, headers={"Authorization": "Bearer alice-token"})
        bob = httpx.Client(timeout=60, headers={"Authorization": "Bearer bob-token"})
        sid = alice.post(f"{srv.url}/sessions", json={}).json()["session_id"]
        assert alice.post(f"{srv.url}/sessions/{sid}/run", json={"code": "x = 6"}).json()["results"][0]["ok"]
        ran = bob.post(f"{srv.url}/sessions/{sid}/run", json={"code": "x = 0"})
        assert ran.status_code == 404 and ran.json()["error"] == "unknown_session", ran.text
        gone = bob.delete(f"{srv.url}/sessions/{sid}")
        assert gone.status_code == 404 and gone.json()["error"] == "unknown_session", gone.text
        out = alice.post(f"{srv.url}/sessions/{sid}/run", json={"code": "print(x * 7)"}).json()["results"][0]
        assert out["output"] == "42\n", out
        assert alice.delete(f"{srv.url}/sessions/{sid}").status_code == 200
    finally:
        srv.kill()


def test_one_client_cannot_reserve_the_whole_budget():
    """Two server tenants, A parking idle sessions as fast as it may: A's sessions reserve at most its share of the
    memory budget (half by default): one more is a 429 marked `memory_full` naming `--max-memory-per-client-mb`,
    while tenant B still opens its sessions."""
    from starlette.testclient import TestClient

    from retool_trl.sandbox.server.app import create_app
    from retool_trl.sandbox.server.table import SessionTable

    table = _table(tokens={"a-token": "a", "b-token": "b"})
    try:
        client = TestClient(create_app(table.config, table))  # no lifespan: sessions fork at their first cell
        a, b = {"Authorization": "Bearer a-token"}, {"Authorization": "Bearer b-token"}
        assert [client.post("/sessions", json={}, headers=a).status_code for _ in range(2)] == [200, 200]
        refused = client.post("/sessions", json={}, headers=a)
        assert refused.status_code == 429 and refused.json()["error"] == "memory_full", refused.text
        assert "--max-memory-per-client-mb" in refused.json()["detail"], refused.text
        assert [client.post("/sessions", json={}, headers=b).status_code for _ in range(2)] == [200, 200]
        assert table.reserved_mb == 1024
        # More than one client may ever hold never fits: a 400 naming the option, not a 429 worth waiting for.
        huge = client.post("/sessions", json={"memory_mb": 768}, headers=b)
        assert huge.status_code == 400 and "--max-memory-per-client-mb" in huge.json()["detail"], huge.text
    finally:
        SessionTable.close(table)


def test_a_server_whose_default_budget_holds_no_session_refuses_to_start(monkeypatch, capsys):
    """An operator starting the server on a small machine whose default budget (half its memory) is below the
    default `memory_mb`: the server refuses to start in one line naming `--total-memory-mb`, where it used to start
    and answer every open with an error."""
    from retool_trl.cli import sandbox_server
    from retool_trl.errors import UserError
    from retool_trl.sandbox.server import table

    monkeypatch.setattr(table, "node_share_memory_mb", lambda: 512)
    with pytest.raises(UserError) as refused:
        sandbox_server.main(["--port", "9", "--memory-mb", "1024"])
    line = str(refused.value)
    assert "--total-memory-mb" in line and "512" in line and "\n" not in line, line
