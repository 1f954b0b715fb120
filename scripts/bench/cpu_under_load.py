#!/usr/bin/env python
"""User CPU per training step of the quickstart, on a quiet machine and under load from other processes.

On a shared machine the same quickstart burnt about four times the user CPU when other jobs kept the cores busy, for
identical results: threads that wait by spinning (OpenMP's worker threads spin before they sleep) spin longer when the
thread they wait for is descheduled. This runs the quickstart (a few steps, a small held-out set) side by side quiet
and with `--load` busy processes, each way with OpenMP's wait policy as the command sets it and as `--policies` lists,
and prints user and system CPU per step, involuntary context switches and wall time, from the kernel's account of the
child (`wait4`).

    python scripts/bench/cpu_under_load.py [--steps 6] [--load 8] [--policies default,ACTIVE] [--json]

`default` is what `retool-trl quickstart` does on its own; `ACTIVE` forces OpenMP's spin-waiting, for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import results_log


def busy_processes(n: int) -> list[subprocess.Popen]:
    """`n` processes that keep a core busy in user mode, as other jobs on a shared machine do."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def run_quickstart(steps: int, num_eval: int, policy: str) -> dict:
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    with tempfile.TemporaryDirectory(prefix="cpu_under_load_") as out:
        command = [
            sys.executable,
            "-m",
            "retool_trl",
            "quickstart",
            "--output-dir",
            out,
            "--max-steps",
            str(steps),
            "--num-eval",
            str(num_eval),
        ]
        started = time.perf_counter()
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        if status != 0:
            raise SystemExit(f"the quickstart failed (status {status}): {proc.stderr.read().decode()[-2000:]}")
    train_steps = 2 * steps  # the tool run and the text run
    return {
        "user_s": usage.ru_utime,
        "sys_s": usage.ru_stime,
        "user_s_per_step": usage.ru_utime / train_steps,
        "involuntary_switches": usage.ru_nivcsw,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps of each quickstart run")
    parser.add_argument("--num-eval", type=int, default=32, help="held-out problems (before and after)")
    parser.add_argument("--load", type=int, default=4 * (os.cpu_count() or 1), help="busy processes when loaded")
    parser.add_argument("--policies", default="default,ACTIVE", help="OpenMP wait policies to compare, comma list")
    parser.add_argument("--json", action="store_true")
    results_log.add_arguments(parser)
    args = parser.parse_args()
    run = results_log.conditions()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    row: dict = {"steps": args.steps, "load_processes": args.load, "policies": policies}
    for condition in ("quiet", "loaded"):
        for policy in policies:
            load = busy_processes(args.load) if condition == "loaded" else []
            try:
                measured = run_quickstart(args.steps, args.num_eval, policy)
            finally:
                for p in load:
                    p.kill()
                    p.wait()
            name = f"{condition}_{policy.lower()}"
            row.update({f"{name}_{k}": round(v, 3) if isinstance(v, float) else v for k, v in measured.items()})
            print(
                f"{condition:<7} OMP_WAIT_POLICY={policy:<8} user CPU {measured['user_s']:7.1f} s "
                f"({measured['user_s_per_step']:.2f} s/step), sys {measured['sys_s']:.1f} s, "
                f"{measured['involuntary_switches']} involuntary switches, wall {measured['wall_s']:.0f} s",
                flush=True,
            )
    for policy in policies:
        p = policy.lower()
        row[f"loaded_vs_quiet_user_{p}"] = round(row[f"loaded_{p}_user_s"] / row[f"quiet_{p}_user_s"], 3)
    results_log.record("cpu_under_load", row, run, enabled=not args.no_record)
    if args.json:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
