"""`bench_sandbox.py --server-capacity`: what one machine serves, under a GRPO-shaped load, through
`retool-trl sandbox-server` on 127.0.0.1 and through a subprocess-per-call service beside it.

The load: `--sessions` sessions at once (64, 256 and 1024 by default), each a client thread making its 2-4 calls back
to back through `RemoteSandbox`, as a rollout's completions do when generation is not the bottleneck. A session's
first cell sets a variable and its later cells use it (state across calls). Each cell computes for a duration drawn
from 1 ms to 1 s (seeded; most are short, as a rollout's: 70% 1-10 ms, 25% 10-100 ms, 5% 100 ms-1 s, log-uniform
within each band; work calibrated on this machine, capped by `--max-cell-ms`); 10% of the calls raise, and 1% of
the sessions end with a cell that sleeps past the time limit. The same load, cell for cell, runs against:

- `retool-trl sandbox-server` (a jail per session that keeps its state; `--workers` CPUs of cells at once);
- the baseline, a stateless service of the design most RL code services use: every call is a fresh
  `python` subprocess (at most one per core at once), and the client replays a session's earlier cells before each
  new one (`RemoteSandbox` does so against any plain SandboxFusion-style service).

Per size and service: calls per second per core (every call of the load over the wall time and `os.cpu_count()`;
the clients share the machine), the latency of a call as its session saw it (p50/p99) and the failures by kind
(`retool_trl.sandbox.base.failure_kind`), next to the failures the load meant (`intended_failures`). `--server-runs`
alternated runs (ours first, then the baseline first, ...); figures are medians with `_min`/`_max`.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from retool_trl.sandbox import RemoteSandbox
from retool_trl.sandbox.base import FAILURE_KINDS, failures_by_kind

DEFAULT_SIZES = (64, 256, 1024)
TIMEOUT_S = 3.0  # each cell's wall-clock limit (the sleeping cells pass it)
BANDS = ((0.70, 1.0, 10.0), (0.25, 10.0, 100.0), (0.05, 100.0, 1000.0))  # (share, from ms, to ms)
WORK = "for _i in range({n}):\n    acc += _i & 7\n"


def calibrate() -> float:
    """Loop iterations of `WORK` per millisecond on this machine (the best of a few tries)."""
    best = 0.0
    for _ in range(3):
        acc, n = 0, 200_000
        start = time.perf_counter()
        for _i in range(n):
            acc += _i & 7
        best = max(best, n / ((time.perf_counter() - start) * 1000))
    return best


def plan_load(sessions: int, per_ms: float, max_cell_ms: float, seed: int = 0) -> list[list[tuple[str, str]]]:
    """Each session's cells, with what each is meant to do (`ok`, `error`, `timeout`)."""
    rng = random.Random(seed)
    plan = []
    for index in range(sessions):
        cells = []
        for call in range(rng.choice((2, 3, 4))):
            share, low, high = rng.choices(BANDS, weights=[b[0] for b in BANDS])[0]
            ms = min(math.exp(rng.uniform(math.log(low), math.log(high))), max_cell_ms)
            body = WORK.format(n=max(1, int(ms * per_ms)))
            first = "acc = 0\n" if call == 0 else ""
            if call and rng.random() < 0.10:  # a later call that fails on its own (the state stays)
                cells.append(("error", f"{first}{body}print(acc // 0)"))
            else:
                cells.append(("ok", f"{first}{body}print(acc % 97)"))
        if index % 100 == 99:  # 1% of the sessions end in a cell past the time limit
            cells.append(("timeout", f"import time\ntime.sleep({TIMEOUT_S * 3})"))
        plan.append(cells)
    return plan


def drive(url: str, plan: list[list[tuple[str, str]]]) -> dict:
    """Runs every session of `plan` at once (a thread each) against `url`; wall, latencies and results."""
    latencies, results, lock = [], [], threading.Lock()
    with RemoteSandbox(url, timeout_s=TIMEOUT_S, max_concurrency=len(plan), request_timeout_s=120.0) as sandbox:
        go = threading.Barrier(len(plan) + 1)

        def session_of(cells):
            session = sandbox.session()
            mine = []
            go.wait()
            for _, code in cells:
                start = time.perf_counter()
                result = session.run(code)
                mine.append((time.perf_counter() - start, result))
            session.close()
            with lock:
                latencies.extend(t for t, _ in mine)
                results.extend(r for _, r in mine)

        with ThreadPoolExecutor(max_workers=len(plan)) as pool:
            futures = [pool.submit(session_of, cells) for cells in plan]
            go.wait()
            start = time.perf_counter()
            for future in futures:
                future.result()
            wall = time.perf_counter() - start
    return {"wall_s": wall, "latencies": latencies, "results": results}


def summarize(sessions: int, runs: list[dict], intended: dict) -> dict:
    """One row of the output: medians over runs (with min-max) and the failures of all runs."""
    cores = os.cpu_count() or 1
    per_run = [
        {
            "calls_per_s_per_core": len(r["latencies"]) / r["wall_s"] / cores,
            "p50_ms": 1000 * statistics.median(r["latencies"]),
            "p99_ms": 1000 * sorted(r["latencies"])[min(len(r["latencies"]) - 1, int(0.99 * len(r["latencies"])))],
        }
        for r in runs
    ]
    row: dict = {"sessions": sessions}
    for key in ("calls_per_s_per_core", "p50_ms", "p99_ms"):
        values = [r[key] for r in per_run]
        row[key] = round(statistics.median(values), 3)
        row[f"{key}_min"], row[f"{key}_max"] = round(min(values), 3), round(max(values), 3)
    failures = {kind: 0 for kind in FAILURE_KINDS}
    for r in runs:
        for kind, count in failures_by_kind(r["results"]).items():
            failures[kind] += count
    row["failures_by_kind"] = failures
    row["intended_failures"] = {kind: count * len(runs) for kind, count in intended.items()}
    row["calls"] = len(runs[0]["latencies"])
    row["runs"] = len(runs)
    return row


# --------------------------------------------------------------------------------------------- the baseline service
class SubprocessService(ThreadingHTTPServer):
    """A stateless SandboxFusion-style `POST /run_code`: each request's program runs in a fresh `python`
    subprocess, at most `workers` at once; the reply is SandboxFusion's (`status`, `run_result`)."""

    daemon_threads = True
    request_queue_size = 4096

    def __init__(self, workers: int):
        super().__init__(("127.0.0.1", 0), _ServiceHandler)
        self.slots = threading.BoundedSemaphore(workers)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request, client_address) -> None:
        # A client that gave up (its read timed out under the 1,024-session load) closed the socket before the reply:
        # the client counts that call as a failure; the service has nothing to add but a traceback per call.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def _run_program(code: str, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        try:
            done = subprocess.run(
                [sys.executable, "-c", code], cwd=tmp, capture_output=True, timeout=timeout_s, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout or b""
            return {"status": "TimeLimitExceeded", "execution_time": time.monotonic() - start,
                    "return_code": None, "stdout": out.decode(errors="replace"), "stderr": ""}  # fmt: skip
        return {
            "status": "Finished",
            "execution_time": time.monotonic() - start,
            "return_code": done.returncode,
            "stdout": done.stdout.decode(errors="replace"),
            "stderr": done.stderr.decode(errors="replace"),
        }


class _ServiceHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the client's connections are reused, as with a real service

    def log_message(self, *args):
        pass

    def do_GET(self):  # no /health: the client sees a plain service and replays
        self._reply(404, {"detail": "not found"})

    def do_POST(self):
        length = int(self.headers.get("Content-Length", 0))
        raw = self.rfile.read(length)
        if len(raw) < length:  # the client went away before its request was read (it gave up): nobody to answer
            self.close_connection = True
            return
        request = json.loads(raw)
        if self.path != "/run_code":
            return self._reply(404, {"detail": "not found"})
        with self.server.slots:
            run = _run_program(request["code"], float(request.get("run_timeout", 10)))
        ok = run["status"] == "Finished" and run["return_code"] == 0
        return self._reply(200, {"status": "Success" if ok else "Failed", "message": "", "run_result": run})

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def run_capacity(args) -> dict:
    """The `--server-capacity` measurements (`args`: `sessions`, `server_runs`, `workers`, `max_cell_ms`)."""
    from sandbox_server_bench import _server  # scripts/bench/ is on sys.path when run as a script

    sizes = tuple(args.sessions or DEFAULT_SIZES)
    workers = args.workers or os.cpu_count() or 1
    per_ms = calibrate()
    out: dict = {"capacity": [], "baseline": []}
    baseline = SubprocessService(workers)
    threading.Thread(target=baseline.serve_forever, daemon=True).start()
    try:
        with _server(workers, max(sizes), max_sessions=4 * max(sizes)) as (url, health):
            drive(url, plan_load(min(8, min(sizes)), per_ms, 2.0, seed=99))  # warm-up: the server's sandbox starts
            for sessions in sizes:
                plan = plan_load(sessions, per_ms, args.max_cell_ms)
                intended = {
                    "cell_error": sum(what == "error" for cells in plan for what, _ in cells),
                    "cell_timeout": sum(what == "timeout" for cells in plan for what, _ in cells),
                }
                ours, theirs = [], []
                for run in range(args.server_runs):
                    order = [(ours, url), (theirs, baseline.url)]
                    for sink, target in order if run % 2 == 0 else order[::-1]:
                        sink.append(drive(target, plan))
                out["capacity"].append(summarize(sessions, ours, intended))
                out["baseline"].append(summarize(sessions, theirs, intended))
                _print(out, sessions)
            out["isolation"] = health.get("isolation")
    finally:
        baseline.shutdown()
        baseline.server_close()
    out.update(
        workers=workers,
        cpu_count=os.cpu_count(),
        max_cell_ms=args.max_cell_ms,
        work_per_ms=round(per_ms),
        load_avg_1m=round(os.getloadavg()[0], 2),
    )
    return out


def _print(out: dict, sessions: int) -> None:
    for name, rows in (("sandbox-server", out["capacity"]), ("subprocess per call", out["baseline"])):
        row = rows[-1]
        failed = ", ".join(f"{k} {v}" for k, v in row["failures_by_kind"].items() if v) or "none"
        print(
            f"{sessions:>5d} sessions  {name:<20s} {row['calls_per_s_per_core']:8.2f} calls/s/core  "
            f"p50 {row['p50_ms']:8.1f} ms  p99 {row['p99_ms']:8.1f} ms  failures: {failed}",
            flush=True,
        )
