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

import json
import os
import sys
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


def _zygote_process(sandbox):
    """The zygote: the outermost process running the jail worker (the sandbox may start it under bubblewrap)."""
    top = psutil.Process(sandbox._zygote.proc.pid)
    for proc in [top, *top.children(recursive=True)]:
        try:
            if any(part.endswith("worker.py") for part in proc.cmdline()):
                return proc
        except psutil.Error:
            continue
    return None


def _idle_cpu_share(proc, seconds: float) -> float | None:
    """The share of one core `proc` took over `seconds` (None where it cannot be read)."""
    try:
        before = sum(proc.cpu_times()[:2])
        time.sleep(seconds)
        return (sum(proc.cpu_times()[:2]) - before) / seconds
    except (psutil.Error, AttributeError):
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
            try:
                mb = sum(psutil.Process(p).memory_full_info().uss for p in mine) / (1 << 20) / size
            except psutil.AccessDenied:  # sessions of another uid, without CAP_SYS_PTRACE (a default container)
                mb = None
        # What watching the parked sessions costs: the zygote's CPU while none of them runs (where no cgroup bounds a
        # session, its watchdog samples every one of them).
        zygote_core = _idle_cpu_share(_zygote_process(sandbox), 5.0)

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
    return {
        "p50_ms": percentile(latencies, 0.5) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
        "mb": mb,
        "zygote_core": zygote_core,
    }


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


PARTS = ("bursts", "closing", "floor", "live", "churn")


def run_scale(args, preload) -> dict:
    """The measurements of `args.parts` (default: all), one row; `preload` None: the sandbox's default."""
    f = args.scale_factor
    parts = set(getattr(args, "parts", None) or PARTS)
    size, live, churn = max(8, round(256 * f)), max(8, round(1024 * f)), max(20, round(5000 * f))
    threads = min(32, size)
    workers = args.workers or os.cpu_count() or 1
    loaded = {} if preload is None else {"preload": preload}
    row: dict = {"scale_factor": f, "burst_sessions": size, "live_sessions": live, "churn_sessions": churn}
    with LocalSandbox(num_workers=workers, timeout_s=30.0, **loaded) as sandbox:
        sandbox.session().run("pass")  # the zygote's start is paid once per trainer
        if "bursts" in parts:
            plain = bench_bursts(sandbox, size, args.bursts, threads, reserve=False, idle_s=args.idle)
            reserved = bench_bursts(sandbox, size, args.bursts, threads, reserve=True, idle_s=args.idle)
            row.update(
                burst_p50_ms=reserved["p50_ms"],
                burst_p99_ms=reserved["p99_ms"],
                burst_max_ms=reserved["max_ms"],
                burst_noreserve_p50_ms=plain["p50_ms"],
                burst_noreserve_p99_ms=plain["p99_ms"],
                burst_noreserve_max_ms=plain["max_ms"],
                fresh_per_s=plain["per_s"],
            )
        if "closing" in parts:
            closing = bench_burst_close(sandbox, size, args.bursts, threads, idle_s=args.idle)
            row.update(
                burst_close_p50_ms=closing["p50_ms"],
                burst_close_p99_ms=closing["p99_ms"],
                burst_close_max_ms=closing["max_ms"],
            )
        if "live" in parts:
            held = bench_live(sandbox, live, threads, rounds=3)
            row.update(
                live_follow_p50_ms=held["p50_ms"],
                live_follow_p99_ms=held["p99_ms"],
                live_mb_per_session=held["mb"],
                live_zygote_idle_core=held["zygote_core"],
            )
        if "churn" in parts:
            gone = bench_churn(sandbox, churn, threads)
            row.update(
                churn_rss_growth_mb=gone["rss_growth_mb"],
                churn_fds_left=gone["fds_left"],
                churn_cgroups_left=gone["cgroups_left"],
                churn_per_s=gone["per_s"],
            )
        isolation = sandbox.isolation_used
    if "floor" in parts:
        row["fresh_floor_per_s"] = bench_floor(workers, preload, size)
    row.update(
        isolation=isolation,
        workers=workers,
        threads=threads,
        cpu_count=os.cpu_count(),
        load_avg_1m=os.getloadavg()[0],
    )
    if parts != set(PARTS):
        row["parts"] = sorted(parts)
        return row
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


VERSUS_METRICS = (
    "live_follow_p50_ms",
    "live_follow_p99_ms",
    "churn_per_s",
    "live_mb_per_session",
    "live_zygote_idle_core",
)
# A default rootful container; 1,024 live sessions hold more descriptors in the trainer than 4,096.
CONTAINER = ("podman", "--runtime", "runc", "run", "--rm", "--ulimit", "nofile=16384:16384", "--ulimit")


def _tree_at(commit: str) -> tuple[Path, str]:
    """A detached worktree of `commit` (made once, under the temp directory) and its full hash."""
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parents[2]
    full = subprocess.run(["git", "rev-parse", commit], cwd=root, capture_output=True, text=True, check=True)
    full = full.stdout.strip()
    tree = Path(tempfile.gettempdir()) / f"retool-scale-{full[:10]}"
    if not (tree / "retool_trl").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), full], cwd=root, check=True)
    return tree, full


def run_versus(args) -> dict:
    """`--scale --versus COMMIT`: the measurements of `--parts` (default live and churn) of this checkout and of
    COMMIT's package, alternated `--versus-runs` times, each run a fresh process (inside a default rootful podman
    container with `--in-container`, where no cgroup bounds a session and the zygote's watchdog samples every one);
    the same benchmark code drives both. Medians with min-max, and this checkout's median over COMMIT's."""
    import statistics
    import subprocess

    root = Path(__file__).resolve().parents[2]
    old_tree, old = _tree_at(args.versus)
    parts = args.parts or ["live", "churn"]
    child = [sys.executable, str(Path(__file__).resolve()), "--child", "--parts", ",".join(parts)]
    child += ["--scale-factor", str(args.scale_factor), "--bursts", str(args.bursts), "--idle", str(args.idle)]
    runs: dict = {"new": [], "old": []}
    for i in range(args.versus_runs):
        for side, tree in (("new", root), ("old", old_tree)) if i % 2 == 0 else (("old", old_tree), ("new", root)):
            command = list(child)
            if args.in_container:
                command = [*CONTAINER, "nproc=8192:8192", "-w", str(root), "-e", f"PYTHONPATH={tree}"]
                command += ["--rootfs", "/:O", *child]
            started = time.perf_counter()
            out = subprocess.run(
                command, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, timeout=1800
            )
            if out.returncode != 0:
                raise SystemExit(f"the {side} run failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            if Path(row["package"]).resolve().parents[1] != tree.resolve():
                raise SystemExit(f"the {side} run imported {row['package']}, not the package of {tree}")
            runs[side].append(row)
            shown = ", ".join(f"{k} {row[k]:.3g}" for k in VERSUS_METRICS if row.get(k) is not None)
            took = time.perf_counter() - started
            print(f"run {i + 1}/{args.versus_runs} {side}: {shown} ({took:.0f} s)", flush=True)
    result: dict = {"versus": old[:10], "runs": args.versus_runs, "in_container": args.in_container, "parts": parts}
    result["isolation"] = {side: runs[side][0]["isolation"] for side in runs}
    for key in VERSUS_METRICS:
        if any(r.get(key) is None for r in runs["new"] + runs["old"]):
            continue
        for side in runs:
            values = [r[key] for r in runs[side]]
            result[f"{key}_{side}"] = statistics.median(values)
            result[f"{key}_{side}_min"], result[f"{key}_{side}_max"] = min(values), max(values)
        result[f"{key}_ratio"] = result[f"{key}_new"] / result[f"{key}_old"]
    print(f"this checkout vs {old[:10]} ({args.versus_runs} alternated runs each, medians (min-max)):")
    for key in VERSUS_METRICS:
        if f"{key}_ratio" in result:
            new, old_ = (
                f"{result[f'{key}_{s}']:.3g} ({result[f'{key}_{s}_min']:.3g}-{result[f'{key}_{s}_max']:.3g})"
                for s in ("new", "old")
            )
            print(f"  {key:24s} {new:>22s}  vs {old_:>22s}  ratio {result[f'{key}_ratio']:.3f}")
    return result


if __name__ == "__main__":  # `--child`: one run of `run_scale` for `run_versus`, its row as the last line
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--parts", type=lambda text: text.split(","), default=None)
    parser.add_argument("--scale-factor", type=float, default=1.0)
    parser.add_argument("--bursts", type=int, default=6)
    parser.add_argument("--idle", type=float, default=4.0)
    parser.add_argument("--workers", type=int, default=None)
    cli = parser.parse_args()
    import retool_trl

    result = run_scale(cli, None)
    print(json.dumps({**result, "package": retool_trl.__file__}))
