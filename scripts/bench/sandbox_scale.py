"""`bench_sandbox.py --scale`: the local sandbox under a whole GRPO batch, through its public API.

Four measurements, each sized by `--scale-factor` (1.0 = the sizes below; a smaller factor to try it out quickly):

- bursts closing: the same burst after `reserve`, each session closed right after its first call (completions that
  answer after one call close while others' first calls still arrive);
- bursts: `--bursts` bursts of 256 fresh sessions (one GRPO step's completions), their first calls from 32 threads,
  once after `reserve(256)` and `--idle` seconds (what the rollout does while the model generates) and once without
  (bursts 2 s apart): first-call p50/p99/max, and fresh sessions per second without `reserve`;
- floor: how fast this machine can prepare jails at all (`reserve(n)` into an idle sandbox, until all are ready):
  the fresh-session rate to compare with;
- live: 1,024 stateful sessions held at once, follow-up calls from 32 threads (p50/p99), and the unique memory per
  session (the sandbox cgroup's usage, or the jails' USS, over the live sessions);
- churn: 5,000 sessions opened, run and closed from 32 threads: the trainer's RSS growth, and what is left behind
  (jails, cgroup directories, descriptors).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from retool_trl.sandbox import LocalSandbox

FIRST = "x = 6 * 7\nprint(x)"
FOLLOW = "x += 1\nprint(x)"


def percentile(values, q):
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _jail_dirs(sandbox) -> list[Path]:
    roots = [Path(path) for kind, path in sandbox._cgroups.roots if kind in ("pids", "v2")]
    return [child for root in roots[:1] for child in root.iterdir() if child.is_dir()]


def _live_jails(sandbox) -> list[int]:
    pids = []
    for child in _jail_dirs(sandbox):
        try:
            pids += [int(p) for p in (child / "cgroup.procs").read_text().split()[:1]]
        except (OSError, ValueError):
            continue
    return pids


def _first_call(sandbox) -> tuple[float, object]:
    session = sandbox.session()
    start = time.perf_counter()
    result = session.run(FIRST)
    elapsed = time.perf_counter() - start
    assert result.ok, result
    return elapsed, session


def bench_bursts(sandbox, size: int, bursts: int, threads: int, reserve: bool, idle_s: float) -> dict:
    latencies, rates = [], []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(bursts):
            if reserve:
                sandbox.reserve(size)
            time.sleep(idle_s if reserve else 2.0)
            start = time.perf_counter()
            done = list(pool.map(lambda _: _first_call(sandbox), range(size)))
            rates.append(size / (time.perf_counter() - start))
            latencies += [elapsed for elapsed, _ in done]
            for _, session in done:
                session.close()
    return {
        "p50_ms": percentile(latencies, 0.5) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
        "max_ms": max(latencies) * 1e3,
        "per_s": percentile(rates, 0.5),
    }


def bench_burst_close(sandbox, size: int, bursts: int, threads: int, idle_s: float) -> dict:
    """The burst after `reserve` in which every session closes right after its first call, as completions that
    answer after one call do while other completions' first calls are still arriving: first-call p50/p99/max."""

    def call_then_close(_):
        elapsed, session = _first_call(sandbox)
        session.close()
        return elapsed

    latencies = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(bursts):
            sandbox.reserve(size)
            time.sleep(idle_s)
            latencies += list(pool.map(call_then_close, range(size)))
    return {
        "p50_ms": percentile(latencies, 0.5) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
        "max_ms": max(latencies) * 1e3,
    }


def _parked(pid: int) -> bool:
    """Whether a jail has reached its wait for requests (blocked reading fd 3): set up, ready for a first call."""
    try:
        return Path(f"/proc/{pid}/syscall").read_text().split()[:2] in (["0", "0x3"], ["63", "0x3"])
    except OSError:
        return False


def bench_floor(workers: int, preload, size: int) -> float:
    """Jails this machine prepares per second, forks and set-up included: `reserve(size)` in an idle sandbox that
    keeps no spares of its own, timed until every reserved jail waits for its first request."""
    with LocalSandbox(num_workers=workers, timeout_s=30.0, preload=preload, spares=0) as sandbox:
        sandbox.session().run("pass")
        time.sleep(1.0)
        base = len(_live_jails(sandbox))
        start = time.perf_counter()
        sandbox.reserve(size)
        while time.perf_counter() - start < 120:
            ready = [pid for pid in _live_jails(sandbox) if _parked(pid)]
            if len(ready) >= base + size:
                break
            time.sleep(0.002)
        return size / (time.perf_counter() - start)


def _memory_usage(sandbox) -> int | None:
    for kind, path in sandbox._cgroups.roots:
        name = {"memory1": "memory.usage_in_bytes", "v2": "memory.current"}.get(kind)
        if name and os.path.exists(os.path.join(path, name)):
            return int(Path(path, name).read_text())
    return None


def bench_live(sandbox, size: int, threads: int, rounds: int) -> dict:
    time.sleep(1.0)
    before = _memory_usage(sandbox)
    jails_before = set(_live_jails(sandbox))
    with ThreadPoolExecutor(threads) as pool:
        sessions = [session for _, session in pool.map(lambda _: _first_call(sandbox), range(size))]
        time.sleep(2.0)  # spares refilled meanwhile are not the sessions' memory: measured apart below
        mine = {s._proc.host_pid for s in sessions}
        usage = _memory_usage(sandbox)
        if usage is not None and before is not None:
            spares = set(_live_jails(sandbox)) - mine - jails_before
            mb = (usage - before) / (1 << 20) / (size + len(spares))
        else:
            mb = sum(psutil.Process(p).memory_full_info().uss for p in mine) / (1 << 20) / size

        def follow(session):
            start = time.perf_counter()
            result = session.run(FOLLOW)
            assert result.ok, result
            return time.perf_counter() - start

        latencies = []
        for _ in range(rounds):
            latencies += list(pool.map(follow, sessions))
    for session in sessions:
        session.close()
    return {"p50_ms": percentile(latencies, 0.5) * 1e3, "p99_ms": percentile(latencies, 0.99) * 1e3, "mb": mb}


def bench_churn(sandbox, total: int, threads: int) -> dict:
    me = psutil.Process()

    def one(_):
        elapsed, session = _first_call(sandbox)
        session.close()
        return elapsed

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(min(total, 200))))  # warm: thread stacks, caches
        time.sleep(2.0)
        rss, fds, dirs = me.memory_info().rss, me.num_fds(), len(_jail_dirs(sandbox))
        start = time.perf_counter()
        latencies = list(pool.map(one, range(total)))
        elapsed = time.perf_counter() - start
    time.sleep(3.0)
    return {
        "rss_growth_mb": (me.memory_info().rss - rss) / (1 << 20),
        "fds_left": me.num_fds() - fds,
        "cgroups_left": len(_jail_dirs(sandbox)) - dirs,
        "per_s": total / elapsed,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
    }


def run_scale(args, preload) -> dict:
    f = args.scale_factor
    size, live, churn = max(8, round(256 * f)), max(8, round(1024 * f)), max(20, round(5000 * f))
    threads = min(32, size)
    workers = args.workers or os.cpu_count() or 1
    row: dict = {"scale_factor": f, "burst_sessions": size, "live_sessions": live, "churn_sessions": churn}
    with LocalSandbox(num_workers=workers, timeout_s=30.0, preload=preload) as sandbox:
        sandbox.session().run("pass")  # the zygote's start is paid once per trainer
        plain = bench_bursts(sandbox, size, args.bursts, threads, reserve=False, idle_s=args.idle)
        reserved = bench_bursts(sandbox, size, args.bursts, threads, reserve=True, idle_s=args.idle)
        closing = bench_burst_close(sandbox, size, args.bursts, threads, idle_s=args.idle)
        held = bench_live(sandbox, live, threads, rounds=3)
        gone = bench_churn(sandbox, churn, threads)
        isolation = sandbox.isolation_used
    row["fresh_floor_per_s"] = bench_floor(workers, preload, size)
    row.update(
        burst_p50_ms=reserved["p50_ms"],
        burst_p99_ms=reserved["p99_ms"],
        burst_max_ms=reserved["max_ms"],
        burst_close_p50_ms=closing["p50_ms"],
        burst_close_p99_ms=closing["p99_ms"],
        burst_close_max_ms=closing["max_ms"],
        burst_noreserve_p50_ms=plain["p50_ms"],
        burst_noreserve_p99_ms=plain["p99_ms"],
        burst_noreserve_max_ms=plain["max_ms"],
        fresh_per_s=plain["per_s"],
        live_follow_p50_ms=held["p50_ms"],
        live_follow_p99_ms=held["p99_ms"],
        live_mb_per_session=held["mb"],
        churn_rss_growth_mb=gone["rss_growth_mb"],
        churn_fds_left=gone["fds_left"],
        churn_cgroups_left=gone["cgroups_left"],
        churn_per_s=gone["per_s"],
        isolation=isolation,
        workers=workers,
        threads=threads,
        cpu_count=os.cpu_count(),
        load_avg_1m=os.getloadavg()[0],
    )
    row["fresh_vs_floor"] = row["fresh_per_s"] / row["fresh_floor_per_s"]
    targets = [
        ("burst after reserve: first-call p99 <= 100 ms", row["burst_p99_ms"] <= 100),
        ("burst after reserve: max <= 500 ms", row["burst_max_ms"] <= 500),
        ("burst after reserve, sessions closing: first-call p99 <= 100 ms", row["burst_close_p99_ms"] <= 100),
        ("without reserve: >= 100 fresh sessions/s", row["fresh_per_s"] >= 100),
        ("without reserve: within 1.5x of the floor", row["fresh_vs_floor"] >= 1 / 1.5),
        ("live: follow-up p99 <= 100 ms", row["live_follow_p99_ms"] <= 100),
        ("live: <= 5 MB per session", row["live_mb_per_session"] <= 5),
        ("churn: RSS growth <= 20 MB", row["churn_rss_growth_mb"] <= 20),
        ("churn: nothing left behind", row["churn_cgroups_left"] <= 0 and row["churn_fds_left"] <= 0),
    ]
    row["targets_met"] = all(ok for _, ok in targets)
    print(
        f"sandbox at scale (x{f:g}): bursts of {size} fresh sessions from {threads} threads, {live} live sessions, "
        f"churn of {churn}; {workers} workers, isolation={isolation}, load average {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} CPUs"
    )
    print(f"{'':40s}{'p50 ms':>10s}{'p99 ms':>10s}{'max ms':>10s}{'per s':>10s}")
    print(
        f"{'burst, after reserve':40s}{reserved['p50_ms']:10.1f}{reserved['p99_ms']:10.1f}{reserved['max_ms']:10.1f}"
    )
    print(
        f"{'burst after reserve, sessions closing':40s}{closing['p50_ms']:10.1f}{closing['p99_ms']:10.1f}"
        f"{closing['max_ms']:10.1f}"
    )
    print(
        f"{'burst, no reserve':40s}{plain['p50_ms']:10.1f}{plain['p99_ms']:10.1f}{plain['max_ms']:10.1f}"
        f"{plain['per_s']:10.0f}"
    )
    print(f"{'floor (jails prepared)':40s}{'':30s}{row['fresh_floor_per_s']:10.0f}")
    print(f"{'live sessions, follow-ups':40s}{held['p50_ms']:10.1f}{held['p99_ms']:10.1f}")
    print(
        f"live: {held['mb']:.1f} MB per session; churn: RSS +{gone['rss_growth_mb']:.1f} MB, "
        f"{gone['fds_left']} fds and {gone['cgroups_left']} cgroups left, {gone['per_s']:.0f} sessions/s"
    )
    print("targets: " + ", ".join(f"{name}: {'met' if ok else 'MISSED'}" for name, ok in targets))
    return row
