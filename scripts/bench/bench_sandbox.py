#!/usr/bin/env python
"""Benchmark of the local sandbox against a subprocess-per-call baseline, measured side by side in one run.

Workload like a rollout: every session makes a first call (its process is forked then) and two follow-up calls that use
the state of the first. Limits and isolation stay on (bubblewrap when it works, per-session uid, rlimits, no network).

    python scripts/bench_sandbox.py [--sessions 64] [--json]
    python scripts/bench_sandbox.py --scale [--scale-factor 1.0] [--json]   # a whole GRPO batch (sandbox_scale.py)
    python scripts/bench_sandbox.py --server [--server-runs 3] [--json]      # retool-trl sandbox-server, 127.0.0.1
    python scripts/bench_sandbox.py --server-capacity [--sessions 64 256 1024] [--json]  # GRPO-shaped load

Jails are pre-started while the model generates: the sandbox keeps `--spares` of them (default: one batch), and the
run idles `--idle` seconds before each phase, as a trainer does while it loads and generates (not measured).
`--jail-startup N` also times the two ways of giving each session its own jail, side by side.

Latency: one call at a time (what a single completion waits for); also one session's calls back to back (a warm
process: the floor of a call). Throughput: `run_many` over all sessions, round by
round (what a batched rollout sees). Baseline: `python -I -S -c SNIPPET` per call, sequential for latency and
`num_workers` at a time for throughput. With `--json` the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import results_log

from retool_trl.sandbox import LocalSandbox
from retool_trl.sandbox.host.local import DEFAULT_PRELOAD
from retool_trl.sandbox.isolation import bwrap_command, bwrap_usable, clean_env, find_bwrap

FIRST = "x = 6 * 7\nprint(x)"
FOLLOW_UPS = ("y = x + 1\nprint(y)", "print(x * y)")
BASELINE_SNIPPET = "x = 6 * 7\nprint(x)"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def bench_pool(sandbox: LocalSandbox, sessions: int, idle_s: float) -> dict:
    # Warm-up: the zygote start (bubblewrap, imports) is paid once per trainer, not per call.
    warm = sandbox.session()
    warm.run("pass")
    warm.close()
    time.sleep(idle_s)  # the trainer starts its sandbox long before the first rollout: jails are pre-started by then

    first, follow = [], []
    for _ in range(sessions):
        s = sandbox.session()
        for code, bucket in ((FIRST, first), *((c, follow) for c in FOLLOW_UPS)):
            t = time.perf_counter()
            r = s.run(code)
            bucket.append(time.perf_counter() - t)
            assert r.ok, r.output
        s.close()

    pool = [sandbox.session() for _ in range(sessions)]
    # A rollout's first code block comes after the model generated for a while; jails are pre-started meanwhile
    # (the sandbox keeps `spares` of them ready). That idle time is not part of the measured throughput.
    time.sleep(idle_s)
    t = time.perf_counter()
    for code in (FIRST, *FOLLOW_UPS):
        results = sandbox.run_many([(s, code) for s in pool])
        assert all(r.ok for r in results), [r.output for r in results if not r.ok][:3]
    elapsed = time.perf_counter() - t
    for s in pool:
        s.close()

    # One session's calls back to back: the floor of a call, without a fresh process's cold caches.
    steady = sandbox.session()
    steady.run(FIRST)
    back_to_back = []
    for _ in range(200):
        t = time.perf_counter()
        steady.run(FOLLOW_UPS[1])
        back_to_back.append(time.perf_counter() - t)
    steady.close()
    return {"first": first, "follow": follow, "steady": back_to_back, "throughput": 3 * sessions / elapsed}


def bench_baseline(calls: int, workers: int) -> dict:
    argv = [sys.executable, "-I", "-S", "-c", BASELINE_SNIPPET]
    latencies = []
    for _ in range(calls):
        t = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True, timeout=30)
        latencies.append(time.perf_counter() - t)
    t = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(lambda _: subprocess.run(argv, capture_output=True, check=True, timeout=30), range(calls)))
    return {"latencies": latencies, "throughput": calls / (time.perf_counter() - t)}


def bench_jail_startup(preload: tuple[str, ...], workers: int, runs: int) -> dict:
    """The two ways to give each session its own jail, measured side by side (wall ms, median of `runs`):
    a process forked from the zygote that enters fresh namespaces (what `LocalSandbox` does, here on demand with no
    jail pre-started), against a fresh bubblewrap + interpreter per session that imports the same modules."""
    forked = []
    with LocalSandbox(num_workers=workers, timeout_s=30.0, preload=preload, spares=0) as sandbox:
        sandbox.session().run("pass")
        for _ in range(runs):
            session = sandbox.session()
            sandbox._ready.clear()  # no jail handed out ahead: each first call forks one
            t = time.perf_counter()
            assert session.run("x = 1").ok
            forked.append(time.perf_counter() - t)
            session.close()
            time.sleep(0.05)
    bwrap = find_bwrap()
    fresh = []
    if bwrap_usable(bwrap, False) is None:
        imports = ";".join(f"import {name}" for name in preload) or "pass"
        argv = bwrap_command(bwrap, __file__, False, 64) + ["--", sys.executable, "-I", "-c", imports]
        for _ in range(runs):
            t = time.perf_counter()
            subprocess.run(argv, capture_output=True, check=True, timeout=120, env=clean_env())
            fresh.append(time.perf_counter() - t)
    return {
        "forked_jail_first_call_ms": percentile(forked, 0.5) * 1000.0,
        "fresh_bwrap_interpreter_ms": percentile(fresh, 0.5) * 1000.0 if fresh else None,
    }


def _record(benchmark: str, row: dict, run: dict, args) -> None:
    """Appends the run's line to the benchmark's results file (unless `--no-record`); with `--json` prints it too."""
    results_log.record(benchmark, row, run, enabled=not args.no_record)
    if args.json:
        print(json.dumps(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sessions",
        type=int,
        nargs="+",
        default=None,
        help="sessions per measurement (3 calls each; default 64); with --server-capacity: the sizes of the load "
        "(default: 64 256 1024)",
    )
    parser.add_argument("--baseline-calls", type=int, default=60)
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument(
        "--spares", type=int, default=None, help="jails kept pre-started (default: --sessions, one rollout batch)"
    )
    parser.add_argument(
        "--idle",
        type=float,
        default=5.0,
        help="seconds of 'generation' before the throughput rounds, when jails are pre-started",
    )
    parser.add_argument(
        "--preload",
        default="default",
        help="modules the zygote imports: 'default' (numpy, sympy, ...), 'none', or a comma list",
    )
    parser.add_argument(
        "--jail-startup",
        type=int,
        default=0,
        metavar="RUNS",
        help="also compare a forked jail with a fresh bubblewrap + interpreter per session",
    )
    parser.add_argument("--json", action="store_true", help="also print one JSON object as the last line")
    parser.add_argument("--scale", action="store_true", help="measure a whole GRPO batch instead (see sandbox_scale)")
    parser.add_argument("--scale-factor", type=float, default=1.0, help="with --scale: size of every measurement")
    parser.add_argument("--bursts", type=int, default=6, help="with --scale: bursts of fresh sessions, each way")
    parser.add_argument(
        "--parts",
        type=lambda text: text.split(","),
        default=None,
        help="with --scale: the measurements to run, a comma list of bursts,closing,floor,live,churn (default: all; "
        "with --versus: live,churn)",
    )
    parser.add_argument(
        "--versus", metavar="COMMIT", default=None, help="with --scale: alternate runs with COMMIT's package"
    )
    parser.add_argument("--versus-runs", type=int, default=3, help="with --versus: runs of each, alternated")
    parser.add_argument(
        "--in-container",
        action="store_true",
        help="with --versus: each run in a default rootful podman container (no cgroup: the watchdog samples)",
    )
    parser.add_argument(
        "--server", action="store_true", help="measure retool-trl sandbox-server (sandbox_server_bench)"
    )
    parser.add_argument("--server-runs", type=int, default=3, help="with --server: alternated runs (medians)")
    parser.add_argument("--server-calls", type=int, default=50, help="with --server: small cells per session")
    parser.add_argument("--server-sessions", type=int, default=5, help="with --server: 8-call sessions each way")
    parser.add_argument("--server-work", type=int, default=200_000, help="with --server: size of the session's cell")
    parser.add_argument(
        "--server-capacity",
        action="store_true",
        help="the server's capacity under a GRPO-shaped load beside a subprocess-per-call service (sandbox_capacity)",
    )
    parser.add_argument(
        "--max-cell-ms", type=float, default=1000.0, help="with --server-capacity: the longest cell of the load"
    )
    results_log.add_arguments(parser)
    args = parser.parse_args()
    if args.sessions is not None and min(args.sessions) < 1:
        parser.error(f"--sessions must be >= 1, got {min(args.sessions)}")
    run = results_log.conditions()
    if args.server_capacity:
        from sandbox_capacity import run_capacity  # scripts/bench/ is on sys.path when run as a script

        row = run_capacity(args)
        _record("sandbox_capacity", row, run, args)
        return
    args.sessions = args.sessions[0] if args.sessions else 64

    workers = args.workers or os.cpu_count() or 1
    preload = {"default": DEFAULT_PRELOAD, "none": ()}.get(args.preload, tuple(filter(None, args.preload.split(","))))
    if args.server:
        from sandbox_server_bench import run_server  # scripts/bench/ is on sys.path when run as a script

        row = run_server(args)
        _record("sandbox_server", row, run, args)
        return
    if args.scale:
        from sandbox_scale import PARTS, run_scale, run_versus  # scripts/bench/ is on sys.path when run as a script

        if args.idle == parser.get_default("idle"):
            args.idle = 4.0
        if args.parts and set(args.parts) - set(PARTS):
            parser.error(f"--parts takes {','.join(PARTS)}; got {','.join(args.parts)}")
        if args.versus:
            row = run_versus(args)
            _record("sandbox_scale_versus", row, run, args)
            return
        row = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in run_scale(args, preload).items()}
        _record("sandbox_scale", row, run, args)
        return
    spares = args.spares if args.spares is not None else args.sessions
    with LocalSandbox(num_workers=workers, timeout_s=5.0, preload=preload, spares=spares) as sandbox:
        start = time.perf_counter()
        sandbox.session().run("pass")
        startup_s = time.perf_counter() - start
        pool = bench_pool(sandbox, args.sessions, args.idle)
        isolation = sandbox.isolation_used
    base = bench_baseline(args.baseline_calls, workers)

    all_calls = pool["first"] + pool["follow"]
    ms = 1000.0
    row = {
        "p50_ms": percentile(all_calls, 0.5) * ms,
        "p99_ms": percentile(all_calls, 0.99) * ms,
        "first_call_p50_ms": percentile(pool["first"], 0.5) * ms,
        "first_call_p99_ms": percentile(pool["first"], 0.99) * ms,
        "followup_p50_ms": percentile(pool["follow"], 0.5) * ms,
        "followup_p99_ms": percentile(pool["follow"], 0.99) * ms,
        "steady_p50_ms": percentile(pool["steady"], 0.5) * ms,
        "baseline_p50_ms": percentile(base["latencies"], 0.5) * ms,
        "baseline_p99_ms": percentile(base["latencies"], 0.99) * ms,
        "throughput_per_s": pool["throughput"],
        "baseline_throughput_per_s": base["throughput"],
    }
    row["speedup_p50"] = row["baseline_p50_ms"] / row["p50_ms"]
    row["speedup_p99"] = row["baseline_p99_ms"] / row["p99_ms"]
    row["throughput_ratio"] = row["throughput_per_s"] / row["baseline_throughput_per_s"]
    row.update(
        sessions=args.sessions,
        workers=workers,
        spares=spares,
        idle_s=args.idle,
        isolation=isolation,
        startup_s=startup_s,
        cpu_count=os.cpu_count(),
        preload=args.preload,
        load_avg_1m=os.getloadavg()[0],
    )

    print(
        f"sandbox benchmark: {args.sessions} sessions x 3 calls, {workers} workers, isolation={isolation}, "
        f"preload={args.preload}, zygote start {startup_s * 1000:.0f} ms (once), "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(f"{'':28s}{'p50 ms':>10s}{'p99 ms':>10s}{'snippets/s':>12s}")
    print(f"{'pool, first calls':28s}{row['first_call_p50_ms']:10.2f}{row['first_call_p99_ms']:10.2f}{'':>12s}")
    print(f"{'pool, follow-up calls':28s}{row['followup_p50_ms']:10.2f}{row['followup_p99_ms']:10.2f}{'':>12s}")
    print(f"{'one session, back to back':28s}{row['steady_p50_ms']:10.2f}{'':>10s}{'':>12s}")
    print(f"{'pool, all calls':28s}{row['p50_ms']:10.2f}{row['p99_ms']:10.2f}{row['throughput_per_s']:12.0f}")
    print(
        f"{'baseline python -I -S -c':28s}{row['baseline_p50_ms']:10.2f}{row['baseline_p99_ms']:10.2f}"
        f"{row['baseline_throughput_per_s']:12.0f}"
    )
    print(
        f"{'ratio (baseline / pool)':28s}{row['speedup_p50']:9.1f}x{row['speedup_p99']:9.1f}x"
        f"{row['throughput_ratio']:11.1f}x"
    )
    if args.jail_startup:
        row.update(bench_jail_startup(preload, workers, args.jail_startup))
        print(
            f"jail per session: forked from the zygote, first call {row['forked_jail_first_call_ms']:.1f} ms; "
            f"fresh bubblewrap + interpreter {row['fresh_bwrap_interpreter_ms'] or float('nan'):.1f} ms"
        )
    targets = [
        ("p50 >= 20x lower than baseline", row["speedup_p50"] >= 20),
        ("p99 <= 20 ms", row["p99_ms"] <= 20),
        (">= 500 snippets/s", row["throughput_per_s"] >= 500),
        ("first-call p50 <= 2 ms", row["first_call_p50_ms"] <= 2),
    ]
    print("targets: " + ", ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in targets))
    row = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}
    _record("sandbox", row, run, args)


if __name__ == "__main__":
    main()
