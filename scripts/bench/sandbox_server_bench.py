"""`bench_sandbox.py --server`: `retool-trl sandbox-server` on 127.0.0.1 as a trainer's `RemoteSandbox` sees it.

- small-cell latency (p50/p99) at 1, 8 and 32 sessions calling at once (each its own session, warm, back to back),
  and cells/s at the highest;
- a session's cost by call index (8 calls of a cell that computes for a few ms): in a jail on our server (flat) and
  replayed on a stateless SandboxFusion-like service (the in-repo fake, tests/helpers/fake_sandboxfusion.py, which runs
  each request the way SandboxFusion does: one fresh interpreter), where call n runs n cells;
  `session_call_cost_ratio` = 8th call over 1st on ours, `replay_call_cost_ratio` the same replayed;
- `--server-runs` alternated runs (ours then replay, replay then ours, ...): medians, with min-max.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from retool_trl.sandbox import RemoteSandbox

SMALL = "print(6 * 7)"
WORK = "acc = sum(i * i for i in range({n}))"  # a cell with real cost, so that replaying it shows
CALLS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(workers: int, max_concurrency: int = 256, max_sessions: int | None = None):
    port = _free_port()
    cmd = [sys.executable, "-m", "retool_trl", "sandbox-server", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--workers", str(workers), "--max-concurrency", str(max_concurrency)]
    if max_sessions is not None:  # one client (this benchmark) holds them all
        cmd += ["--max-sessions", str(max_sessions), "--max-sessions-per-client", str(max_sessions)]
    # Each live session reserves its memory_mb (RemoteSandbox asks 1024 MB) of the server's memory budget; the cells
    # measured here hold a few MB each, so the budget admits every session, as an operator who knows its load sets it.
    cmd += ["--total-memory-mb", str(1024 * max(max_sessions or 0, max_concurrency))]
    proc = subprocess.Popen(cmd, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("retool-trl sandbox-server did not start")
            time.sleep(0.2)
        yield url, httpx.get(f"{url}/health").json()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)


@contextlib.contextmanager
def _fake():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from helpers.fake_sandboxfusion import FakeSandboxFusion

    srv = FakeSandboxFusion()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv.url
    finally:
        srv.shutdown()
        srv.server_close()


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _latency(url: str, concurrency: int, calls: int) -> dict:
    """Each of `concurrency` threads: its own session, one warm-up call, then `calls` small cells back to back."""
    times: list[float] = []
    lock = threading.Lock()
    with RemoteSandbox(url, timeout_s=10.0, max_concurrency=concurrency) as sb:
        sessions = [sb.session() for _ in range(concurrency)]
        sb.run_many([(s, "pass") for s in sessions])

        def worker(session):
            mine = []
            for _ in range(calls):
                start = time.perf_counter()
                assert session.run(SMALL).output == "42\n"
                mine.append(time.perf_counter() - start)
            with lock:
                times.extend(mine)

        threads = [threading.Thread(target=worker, args=(s,)) for s in sessions]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        for s in sessions:
            s.close()
    return {"p50_ms": _pct(times, 0.5) * 1e3, "p99_ms": _pct(times, 0.99) * 1e3, "cells_per_s": len(times) / wall}


def _by_index(url: str, sessions: int, work: int) -> list[float]:
    """Median ms of each call index over `sessions` sessions of `CALLS` calls each (one session at a time)."""
    per_index: list[list[float]] = [[] for _ in range(CALLS)]
    with RemoteSandbox(url, timeout_s=30.0) as sb:
        warm = sb.session()  # the server's sandbox for these limits starts once, before anything is timed
        warm.run("pass")
        warm.close()
        for _ in range(sessions):
            s = sb.session()
            for i in range(CALLS):
                start = time.perf_counter()
                assert s.run(WORK.format(n=work)).ok
                per_index[i].append(time.perf_counter() - start)
            s.close()
    return [statistics.median(v) * 1e3 for v in per_index]


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_server(args) -> dict:
    """The `--server` measurements (`args`: `server_runs`, `server_calls`, `workers`, `server_work`)."""
    workers = args.workers or os.cpu_count() or 1
    concurrencies = (1, 8, 32)
    lat = {c: [] for c in concurrencies}
    ours, replay = [], []
    with _server(workers) as (url, health), _fake() as fake_url:
        _latency(url, 8, 5)  # warm-up: jails forked, connections open
        for run in range(args.server_runs):
            for c in concurrencies:
                lat[c].append(_latency(url, c, args.server_calls))
            order = [(ours, url), (replay, fake_url)]
            for sink, target in order if run % 2 == 0 else order[::-1]:
                sink.append(_by_index(target, args.server_sessions, args.server_work))
    row: dict = {}
    for c in concurrencies:
        for key in ("p50_ms", "p99_ms", "cells_per_s"):
            row[f"server_{key}_c{c}"] = _summary([r[key] for r in lat[c]])
    row["server_p50_ms"] = row["server_p50_ms_c1"]["median"]
    row["server_p99_ms"] = row["server_p99_ms_c1"]["median"]
    row["server_cells_per_s"] = row[f"server_cells_per_s_c{concurrencies[-1]}"]["median"]
    row["session_call_ms_by_index"] = [statistics.median(r[i] for r in ours) for i in range(CALLS)]
    row["replay_call_ms_by_index"] = [statistics.median(r[i] for r in replay) for i in range(CALLS)]
    row["session_call_cost_ratio"] = _summary([r[-1] / r[0] for r in ours])["median"]
    row["replay_call_cost_ratio"] = _summary([r[-1] / r[0] for r in replay])["median"]
    row["session_call_cost_ratio_range"] = [min(r[-1] / r[0] for r in ours), max(r[-1] / r[0] for r in ours)]
    row["replay_call_cost_ratio_range"] = [min(r[-1] / r[0] for r in replay), max(r[-1] / r[0] for r in replay)]
    row.update(
        runs=args.server_runs,
        workers=workers,
        isolation=health.get("isolation"),
        cpu_count=os.cpu_count(),
        load_avg_1m=os.getloadavg()[0],
    )
    print(f"sandbox server on 127.0.0.1 ({workers} workers, isolation={row['isolation']}), {args.server_runs} runs:")
    print(f"{'concurrency':>12s}{'p50 ms':>24s}{'p99 ms':>24s}{'cells/s':>24s}")
    for c in concurrencies:
        cells = [row[f"server_{k}_c{c}"] for k in ("p50_ms", "p99_ms", "cells_per_s")]
        text = ["{median:.2f} ({min:.2f}-{max:.2f})".format(**v) for v in cells]
        print(f"{c:>12d}" + "".join(f"{t:>24s}" for t in text))
    print("call index:      " + "".join(f"{i + 1:>8d}" for i in range(CALLS)))
    print("ours (ms):       " + "".join(f"{v:8.1f}" for v in row["session_call_ms_by_index"]))
    print("replayed (ms):   " + "".join(f"{v:8.1f}" for v in row["replay_call_ms_by_index"]))
    print(
        f"8th call / 1st: ours {row['session_call_cost_ratio']:.2f}, replayed {row['replay_call_cost_ratio']:.2f} "
        f"(load average {row['load_avg_1m']:.1f} on {row['cpu_count']} CPUs)"
    )
    return row
