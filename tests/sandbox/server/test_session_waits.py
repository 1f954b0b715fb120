"""A client's wait on a busy or vanishing `retool-trl sandbox-server`: a late answer keeps the session and the server,
a server that goes away mid-cell ends the wait."""

from __future__ import annotations


# ------------------------------------------------------------------- remote sessions on a busy sandbox server
class BusySessionsServer:
    """A stand-in for `retool-trl sandbox-server` that is busy: `/health` answers at once, a session's cell answers
    after `delay_s` (it waited for a worker before its own time limit started)."""

    def __init__(self, delay_s: float):
        import json
        import threading
        import time
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from helpers.testing_utils import reply_json

        outer = self
        self.delay_s, self.runs = delay_s, 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                reply_json(self, 200, {"status": "ok", "sessions": 1, "running": 64, "max_concurrency": 64})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path == "/sessions":  # the limits asked for, confirmed
                    reply_json(self, 200, {"session_id": "s1", "limits": body})
                    return
                time.sleep(outer.delay_s)
                outer.runs += 1
                output = f"ran {body['code']}\n"
                reply_json(
                    self,
                    200,
                    {
                        "results": [
                            {"output": output, "ok": True, "timed_out": False, "duration_s": 0.1, "infra_error": False}
                        ]
                    },
                )

            def do_DELETE(self):
                reply_json(self, 200, {"closed": True})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_busy_sandbox_servers_late_answer_keeps_the_session_and_the_server(monkeypatch):
    """Two sandbox servers, native sessions; the one a session lives on is busy and answers a cell late (its cells
    waited for a worker), with a cell limit of 0.5 s. Before, the read timeout was the cell's limit + 30 s whatever
    the server's queue: the late answer was lost, the session's state with it (an infrastructure error), and a live
    server was marked down for 30 s, its load moved onto the others. Now the cell is waited for while the server
    answers its `/health`: the answer is the cell's, the server keeps its sessions. The margin is cut to 0.5 s (a
    check every second) and the answer comes 4 s late, four checks in: the old fixed read timeout would have lost
    it, as it lost an answer 32 s late with the shipped 30 s margin."""
    from retool_trl.sandbox.remote import service
    from retool_trl.sandbox.remote.client import RemoteSandbox

    monkeypatch.setattr(service, "_REPLY_MARGIN_S", 0.5)
    busy, other = BusySessionsServer(delay_s=4.0), BusySessionsServer(delay_s=0.0)
    try:
        with RemoteSandbox([busy.url, other.url], timeout_s=0.5, sessions="native") as sandbox:
            session = sandbox.session()
            session.server = busy.url
            [result] = sandbox.run_many([(session, "x = 1")])
            assert result.ok and not result.infra_error and result.output == "ran x = 1\n"
            assert not sandbox._down_until
    finally:
        busy.close()
        other.close()


def test_a_sandbox_server_that_goes_away_mid_cell_ends_the_wait(monkeypatch):
    """The other side of waiting while the server is alive: the server goes away while a cell waits (its `/health`
    no longer answers). The wait ends at the next check with an infrastructure error, and new sessions go to the
    other server."""
    from retool_trl.sandbox.remote import service
    from retool_trl.sandbox.remote.client import RemoteSandbox

    monkeypatch.setattr(service, "_REPLY_MARGIN_S", 0.5)
    gone, other = BusySessionsServer(delay_s=30.0), BusySessionsServer(delay_s=0.0)
    try:
        with RemoteSandbox([gone.url, other.url], timeout_s=0.5, sessions="native") as sandbox:
            session = sandbox.session()
            session.server = gone.url
            import threading
            import time

            threading.Timer(1.5, gone.close).start()
            started = time.monotonic()
            [result] = sandbox.run_many([(session, "x = 1")])
            assert result.infra_error and "does not answer" in result.output
            assert time.monotonic() - started < 10
            assert gone.url in sandbox._down_until and sandbox.session().server == other.url
    finally:
        other.close()
