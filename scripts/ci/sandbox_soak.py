"""A seeded soak of the local sandbox: many sessions at once with random timing, neighbours running benign cells of
known output beside sessions running the hostile corpus (`soak_corpus.py`: fork bombs, threads, memory of every
kind, disk fill, metadata changes on neighbours' scratch and on the trainer's files, signals, sleeps and spins past
the deadline, output floods, forged results, closes in the middle of a call), for `--minutes`, on one isolation level.

Invariants checked throughout, each reported by name when broken:
- `benign_exact`: every benign cell's output is exactly the known one (a failing benign cell fails with its own error);
- `benign_not_own_failure`: a benign cell is never scored as the model's failure (ok=False) unless it failed itself;
- `no_neighbour_harm`: a benign cell never ends as an infrastructure error or a crash, and its scratch stays its own;
- the hostile verdicts (`memory_bounded`, `tasks_bounded`, `scratch_bounded`, `metadata_outside_scratch`,
  `signals_contained`, `deadline_held`, `output_bounded`, `result_unforgeable`) and `close_returns` (a close in the
  middle of a call ends that call soon);
- `nothing_left_after_close`: a closed session's jail process is gone; after the sandbox closes no process, cgroup or
  scratch directory of it is left and the trainer's descriptors are back where they were, with sessions the trainer
  still references at the close (each then answers that it is closed);
- `trainer_flat`: the trainer's resident memory and descriptors do not grow over the run (bounded growth).

Prints progress, then one JSON object as the last line of stdout; appends it to `scripts/results/sandbox_soak.jsonl`;
exits 1 when an invariant not named in `--expect-known` was broken. Usage:

    python scripts/ci/sandbox_soak.py --minutes 2 --level landlock --seed 1 --json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # results_log: where every run is recorded

import results_log  # noqa: E402
from soak_corpus import Limits, benign_session, hostile_cell, verdicts  # noqa: E402

LEVELS = ("bwrap", "landlock", "none", "auto")
# The trainer is flat when the peaks of its run's second half pass those of its first half by at most this much: its
# descriptors follow the live and reserved jails (which come and go with the load), a leak grows without end.
RSS_GROWTH_MB = 48
FD_GROWTH = 32
PID_GONE_S = 10.0  # a closed session's jail process is gone this soon


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if _alive(child):
                found.append(child)
                todo.append(child)
    return found


class Soak:
    """The run's state: counters, violations, the sessions' jail pids waiting to be seen gone."""

    def __init__(self, args, limits: Limits):
        self.args, self.limits = args, limits
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.broken: Counter[str] = Counter()
        self.examples: list[dict] = []
        self.closed_pids: list[tuple[int, float]] = []  # (jail pid, when its session closed)
        self.neighbour_pids: set[int] = set()
        self.deadline = time.monotonic() + 60 * args.minutes

    def violation(self, invariant: str, detail: str, cell: str = "") -> None:
        with self.lock:
            self.broken[invariant] += 1
            first = self.broken[invariant] <= 3
            if first:
                self.examples.append({"invariant": invariant, "cell": cell, "detail": detail[:300]})
        if first:  # the first few of each; the counts say how many
            print(f"  VIOLATION {invariant}: {detail[:200]}", flush=True)

    def count(self, *names: str) -> None:
        with self.lock:
            self.counts.update(names)

    # --------------------------------------------------------------------------------------------- sessions

    def benign(self, sandbox, rng: random.Random) -> None:
        session = sandbox.session()
        pid = None
        try:
            for cell in benign_session(rng, rng.randrange(3, 9)):
                if time.monotonic() > self.deadline:
                    break
                result = session.run(cell.code)
                pid = pid or _jail_pid(session)
                if pid is not None:
                    with self.lock:
                        self.neighbour_pids.add(pid)
                self.count("cells", "benign")
                if not self._judge_benign(cell, result):
                    break  # a harmed neighbour: its later cells would only repeat the harm
                time.sleep(rng.random() * 0.2)
        finally:
            if pid is not None:
                with self.lock:
                    self.neighbour_pids.discard(pid)
            self._close(session, pid)

    def _judge_benign(self, cell, result) -> bool:
        """Checks a benign cell's result; False when it broke an invariant."""
        harmed = result.infra_error or "SystemError: the interpreter" in result.output or cell.kind == "scratch_intact"
        if cell.fails:
            last = result.output.rstrip("\n").rpartition("\n")[2]
            if result.infra_error or result.ok or last != cell.expected:
                kind = "no_neighbour_harm" if result.infra_error else "benign_exact"
                self.violation(kind, f"{cell.kind}: expected its own error, got {last!r}", cell.kind)
                return False
        elif not result.ok:
            kind = "no_neighbour_harm" if harmed else "benign_not_own_failure"
            self.violation(kind, f"{cell.kind} scored as a failure: {result.output[-200:]!r}", cell.kind)
            return False
        elif result.output != cell.expected:
            kind = "no_neighbour_harm" if harmed else "benign_exact"
            self.violation(kind, f"{cell.kind}: {result.output[-120:]!r} != {cell.expected!r}", cell.kind)
            return False
        self.count("benign_ok")
        return True

    def hostile(self, sandbox, rng: random.Random, canary: str) -> None:
        session = sandbox.session()
        pid = None
        try:
            for _ in range(rng.randrange(1, 4)):
                if time.monotonic() > self.deadline:
                    break
                with self.lock:
                    neighbours = sorted(self.neighbour_pids)[:16]
                context = {"trainer": os.getpid(), "canary": canary, "neighbours": neighbours}
                cell = hostile_cell(rng, self.limits, context)
                if rng.random() < 0.15:  # closed by the trainer in the middle of the call
                    self._close_mid_call(session, rng)
                    return
                before = os.stat(canary)
                result = session.run(cell.code)
                pid = pid or _jail_pid(session)
                self.count("cells", "hostile", f"hostile_{cell.kind}")
                for invariant, detail in verdicts(cell, result, self.limits):
                    self.violation(invariant, detail, cell.kind)
                after = os.stat(canary)
                if (after.st_mode, after.st_mtime_ns) != (before.st_mode, before.st_mtime_ns):
                    self.violation("metadata_outside_scratch", "the trainer's canary file changed", cell.kind)
                    os.chmod(canary, 0o644)
                if not result.ok and rng.random() < 0.5:
                    break  # a broken session: on to a new one
                time.sleep(rng.random() * 0.2)
        finally:
            self._close(session, pid)

    def _close_mid_call(self, session, rng: random.Random) -> None:
        code = f"import time\ntime.sleep({3 * self.limits.timeout_s})"
        done = threading.Event()
        runner = threading.Thread(target=lambda: (session.run(code), done.set()), daemon=True)
        runner.start()
        time.sleep(0.05 + rng.random() * 0.8)
        pid = _jail_pid(session)
        session.close()
        closed_at = time.monotonic()
        if not done.wait(self.limits.timeout_s + 5):
            self.violation("close_returns", f"a call went on {time.monotonic() - closed_at:.1f} s after its close")
        self.count("cells", "closes_mid_call")
        self._close(session, pid)

    def _close(self, session, pid: int | None) -> None:
        session.close()
        self.count("sessions")
        if pid is not None:
            with self.lock:
                self.closed_pids.append((pid, time.monotonic()))

    def check_closed(self, final: bool = False) -> None:
        """Jail processes of closed sessions still alive `PID_GONE_S` after their close break the invariant."""
        now = time.monotonic()
        with self.lock:
            due = [(p, t) for p, t in self.closed_pids if final or now - t >= PID_GONE_S]
            self.closed_pids = [(p, t) for p, t in self.closed_pids if not (final or now - t >= PID_GONE_S)]
        for pid, _ in due:
            if _alive(pid) and (not final or _wait_gone(pid, PID_GONE_S)):
                self.violation("nothing_left_after_close", f"jail process {pid} alive after its session closed")


def _jail_pid(session) -> int | None:
    proc = getattr(session, "_proc", None)
    return getattr(proc, "host_pid", None)


def _wait_gone(pid: int, timeout_s: float) -> bool:
    """True if `pid` is still alive after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _alive(pid)


def run(args) -> dict:
    from retool_trl.sandbox import LocalSandbox

    limits = Limits()
    soak = Soak(args, limits)
    fds_before = _fds()
    canary_dir = tempfile.mkdtemp(prefix="retool-soak-canary-", dir="/var/tmp")
    canary = os.path.join(canary_dir, "trainer-owned.txt")
    Path(canary).write_text("the trainer's own file\n")
    os.chmod(canary, 0o644)
    os.chmod(canary_dir, 0o755)
    sandbox = LocalSandbox(
        num_workers=args.workers,
        timeout_s=limits.timeout_s,
        memory_mb=limits.memory_mb,
        max_processes=limits.max_processes,
        max_file_size_mb=limits.max_file_size_mb,
        max_output_chars=limits.max_output_chars,
        scratch_mb=limits.scratch_mb,
        isolation=args.level,
        allow_root_without_isolation=args.level == "none",
        preload=(),
    )
    report = sandbox.isolation_report()
    print(f"soak: level {report['isolation']}, {args.minutes:g} min, seed {args.seed}", flush=True)
    host_scratch = sandbox._host_scratch
    warm = sandbox.session()
    warm.run("1")
    warm.close()
    rss0, fds0 = _rss_mb(), _fds()
    samples: list[tuple[float, float, int]] = []  # (when, resident MB, descriptors), once a second
    master = random.Random(args.seed)
    seeds = [master.randrange(2**32) for _ in range(args.sessions)]

    def driver(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < soak.deadline:
            try:
                if rng.random() < 0.6:
                    soak.benign(sandbox, rng)
                else:
                    soak.hostile(sandbox, rng, canary)
            except Exception as exc:  # the sandbox's API raised: a failure of the trainer's side
                soak.violation("no_neighbour_harm", f"the sandbox raised {type(exc).__name__}: {exc}")
            time.sleep(rng.random() * 0.3)

    threads = [threading.Thread(target=driver, args=(s,), daemon=True) for s in seeds]
    for t in threads:
        t.start()
    started, last = time.monotonic(), 0.0
    while any(t.is_alive() for t in threads):
        time.sleep(1.0)
        soak.check_closed()
        samples.append((time.monotonic(), _rss_mb(), _fds()))
        if time.monotonic() - last >= args.progress_s:
            last = time.monotonic()
            c = soak.counts
            print(
                f"  {last - started:5.0f} s: {c['cells']} cells ({c['benign_ok']}/{c['benign']} benign ok, "
                f"{c['hostile']} hostile), {c['sessions']} sessions, {sum(soak.broken.values())} violations, "
                f"rss {_rss_mb():.0f} MB, fds {_fds()}",
                flush=True,
            )
    for t in threads:
        t.join()
    time.sleep(1.0)  # the last closes' kills land
    rss_end, fds_end = _rss_mb(), _fds()
    half = started + (samples[-1][0] - started) / 2 if samples else started
    first = [s for s in samples if s[0] <= half] or [(started, rss0, fds0)]
    second = [s for s in samples if s[0] > half] or first
    rss_growth = max(s[1] for s in second) - max(s[1] for s in first)
    fd_growth = max(s[2] for s in second) - max(s[2] for s in first)
    if rss_growth > RSS_GROWTH_MB:
        soak.violation("trainer_flat", f"resident memory peaked {rss_growth:.0f} MB higher in the run's second half")
    if fd_growth > FD_GROWTH:
        soak.violation("trainer_flat", f"descriptors peaked {fd_growth} higher in the run's second half")
    soak.check_closed(final=True)
    # Sessions the trainer still references when the sandbox closes (an evaluation's, a rollout's last batch): the
    # close must end them too, descriptors included, and each must answer that it is closed.
    held = [sandbox.session() for _ in range(8)]
    sandbox.run_many([(session, "x = 1") for session in held])
    sandbox.close()
    leaks = _leaks(host_scratch, fds_before)
    answers = {session.run("print(x)").output for session in held}
    if answers != {"SessionError: this session is closed"}:
        soak.violation("nothing_left_after_close", f"a session held past close() answered {sorted(answers)!r}")
    del held
    for what, n in leaks.items():
        if n:
            soak.violation("nothing_left_after_close", f"{n} {what} left after the sandbox closed")
    os.unlink(canary)
    os.rmdir(canary_dir)
    known = set(args.expect_known)
    c = soak.counts
    return {
        "minutes": args.minutes,
        "level": report["isolation"],
        "seed": args.seed,
        "cells": c["cells"],
        "benign": c["benign"],
        "benign_ok": c["benign_ok"],
        "hostile": c["hostile"],
        "closes_mid_call": c["closes_mid_call"],
        "sessions": c["sessions"],
        "hostile_by_kind": {k[len("hostile_") :]: v for k, v in sorted(c.items()) if k.startswith("hostile_")},
        "violations": sorted(soak.broken),
        "violation_counts": dict(sorted(soak.broken.items())),
        "violation_examples": soak.examples,
        "unexpected": sorted(set(soak.broken) - known),
        "known": sorted(set(soak.broken) & known),
        "leaks": leaks,
        "trainer_rss_growth_mb": round(rss_growth, 1),
        "trainer_rss_peak_mb": round(max([rss_end] + [s[1] for s in samples]), 1),
        "trainer_fd_growth": fd_growth,
        "trainer_rss_start_end_mb": [round(rss0, 1), round(rss_end, 1)],
        "trainer_fds_start_end": [fds0, fds_end],
        "missing": report.get("missing", []),
    }


def _leaks(host_scratch: str | None, fds_before: int) -> dict:
    """What the closed sandbox left: its processes, cgroups, scratch directories, and the trainer's descriptors."""
    deadline = time.monotonic() + 10
    while _descendants(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.2)
    cgroups = {
        os.path.realpath(p)
        for top in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
        for p in glob.glob(f"{top}/**/retool-sandbox-{os.getpid()}-*", recursive=True)
    }
    return {
        "processes": len(_descendants(os.getpid())),
        "cgroups": len(cgroups),
        "scratch": int(bool(host_scratch and os.path.exists(host_scratch))),
        "fds": max(0, _fds() - fds_before - 2),  # the import of the sandbox keeps a couple open (its logging)
    }


def _levels_here() -> list[str]:
    """The isolation levels that start on this machine, as this user (`none` is not isolation: never listed)."""
    from retool_trl.sandbox import LocalSandbox

    found = []
    for level in ("bwrap", "landlock"):
        try:
            with LocalSandbox(num_workers=1, isolation=level, preload=(), spares=0) as sandbox:
                if sandbox.isolation_report()["isolation"] == level:
                    found.append(level)
        except Exception:  # the level cannot start here (SandboxStartError and the like): not listed
            continue
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=2.0, help="how long to run (default: 2)")
    parser.add_argument("--level", choices=LEVELS, default="auto", help="the isolation level (default: auto)")
    parser.add_argument("--seed", type=int, default=0, help="the seed of every random choice (default: 0)")
    parser.add_argument("--sessions", type=int, default=6, help="sessions driven at once (default: 6)")
    parser.add_argument("--workers", type=int, default=2, help="the sandbox's CPU slots (default: 2)")
    parser.add_argument("--progress-s", type=float, default=15.0, help="seconds between progress lines")
    parser.add_argument(
        "--expect-known",
        type=lambda s: [x for x in s.split(",") if x],
        default=[],
        help="comma-separated invariants known broken on this level: reported, but do not fail the run",
    )
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line at the end")
    parser.add_argument("--list-levels", action="store_true", help="print the levels that start here, and exit")
    results_log.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.minutes <= 0 or args.sessions < 1 or args.workers < 1:
        print("sandbox_soak: --minutes, --sessions and --workers must be positive", file=sys.stderr)
        return 2
    if args.list_levels:
        print(" ".join(_levels_here()))
        return 0
    conditions = results_log.conditions()
    try:
        row = run(args)
    except Exception as exc:  # the level does not work here, or the sandbox could not start
        print(f"sandbox_soak: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(
        f"soak done: {row['cells']} cells, {row['benign_ok']}/{row['benign']} benign ok, violations "
        f"{row['violation_counts'] or 'none'} (known: {row['known'] or 'none'}), leaks {row['leaks']}",
        flush=True,
    )
    results_log.record("sandbox_soak", row, conditions, enabled=not args.no_record)
    print(json.dumps(row) if args.json else json.dumps(row, indent=1), flush=True)
    return 1 if row["unexpected"] else 0


if __name__ == "__main__":
    sys.exit(main())
