"""What the per-stage timings (`retool/time/*`) cost: GRPO step time with and without them, alternated.

Each run trains the shipped quickstart model for `--steps` GRPO steps (the quickstart's arithmetic task, the real
local sandbox, shared by every run so that its start is paid once) from the same checkpoint and seed. Runs alternate
between the trainer as shipped ("timed") and the same trainer with the timings switched off ("untimed": no step
clock, no callback, the sandbox and engine unwrapped), the order flipping every repeat. A run's figure is the median
of its steps' wall times (its first step, which warms up, left out; the steps' wall is measured by a callback of this
script, outside the trainer's own clock). Figures: the medians over runs with min-max, and the ratio timed/untimed
of runs paired in the same repeat.

    python scripts/bench/bench_stage_timings.py [--repeats 5] [--steps 6] [--json] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_log  # noqa: E402


def _run(timed: bool, steps: int, sandbox, out: Path) -> float:
    """Trains one run; the median wall seconds of its steps after the first."""
    from transformers import AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from retool_trl.quickstart.arithmetic import arithmetic_plan
    from retool_trl.quickstart.plan import QuickstartArguments, rl_config
    from retool_trl.trainer import ReToolTrainer
    from retool_trl.training.stage_timings import StageTimingCallback

    class Wall(TrainerCallback):
        def __init__(self):
            self.walls = []

        def on_step_begin(self, *args, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            self.walls.append(time.perf_counter() - self.started)

    args = QuickstartArguments(output_dir=str(out), max_steps=steps, num_train=64, num_eval=4)
    plan = arithmetic_plan(args)
    tokenizer = AutoTokenizer.from_pretrained(plan.model, padding_side="left")
    config = rl_config(args, out, with_tools=True, disable_tqdm=True, max_steps=steps)
    trainer = ReToolTrainer(
        plan.model, None, args=config, train_dataset=plan.splits["train"], processing_class=tokenizer, sandbox=sandbox
    )
    if not timed:  # everything the timings add, taken away
        trainer.remove_callback(StageTimingCallback)
        trainer._stage_clock = None
        trainer.timed_sandbox = lambda inner: inner
        trainer.timed_engine = lambda engine: engine
    for noisy in (PrinterCallback, ProgressCallback):  # a log dict per step on the console says nothing here
        trainer.remove_callback(noisy)
    wall = Wall()
    trainer.add_callback(wall)
    trainer.train()
    logged = any("retool/time/step" in entry for entry in trainer.state.log_history)
    if logged != timed:
        raise SystemExit(f"the {'timed' if timed else 'untimed'} run {'did not log' if timed else 'logged'} timings")
    return statistics.median(wall.walls[1:] or wall.walls)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="pairs of runs (timed, untimed), order alternating")
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps per run (the first is left out)")
    parser.add_argument("--json", action="store_true", help="also print one JSON object as the last line")
    results_log.add_arguments(parser)
    args = parser.parse_args()
    if args.repeats < 1 or args.steps < 2:
        parser.error("--repeats must be >= 1 and --steps >= 2 (the first step is left out)")
    run = results_log.conditions()

    import torch

    from retool_trl.quickstart.arithmetic import arithmetic_plan
    from retool_trl.quickstart.plan import QuickstartArguments, rl_config
    from retool_trl.sandbox.factory import sandbox_from_config

    torch.set_num_threads(1)  # as the quickstart on a busy machine
    times = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        quick = QuickstartArguments(output_dir=tmp)
        arithmetic_plan(quick)
        sandbox = sandbox_from_config(rl_config(quick, Path(tmp), with_tools=True))
        try:
            for repeat in range(args.repeats):
                for timed in (True, False) if repeat % 2 == 0 else (False, True):
                    step_s = _run(timed, args.steps, sandbox, Path(tmp) / f"r{repeat}{'t' if timed else 'u'}")
                    times[timed].append(step_s)
                    print(
                        f"repeat {repeat}: {'timed' if timed else 'untimed'} {step_s * 1000:.0f} ms/step", flush=True
                    )
        finally:
            sandbox.close()
    ratios = [t / u for t, u in zip(times[True], times[False])]
    figures = {
        "timed_step_s": round(statistics.median(times[True]), 4),
        "timed_step_s_min": round(min(times[True]), 4),
        "timed_step_s_max": round(max(times[True]), 4),
        "untimed_step_s": round(statistics.median(times[False]), 4),
        "untimed_step_s_min": round(min(times[False]), 4),
        "untimed_step_s_max": round(max(times[False]), 4),
        "timed_vs_untimed": round(statistics.median(ratios), 4),
        "timed_vs_untimed_min": round(min(ratios), 4),
        "timed_vs_untimed_max": round(max(ratios), 4),
        "repeats": args.repeats,
        "steps": args.steps,
    }
    print(
        f"\nstep time, median of {args.repeats} runs each (min-max):\n"
        f"  timed    {figures['timed_step_s'] * 1000:7.0f} ms ({figures['timed_step_s_min'] * 1000:.0f}-"
        f"{figures['timed_step_s_max'] * 1000:.0f})\n"
        f"  untimed  {figures['untimed_step_s'] * 1000:7.0f} ms ({figures['untimed_step_s_min'] * 1000:.0f}-"
        f"{figures['untimed_step_s_max'] * 1000:.0f})\n"
        f"  timed / untimed {figures['timed_vs_untimed']:.3f} ({figures['timed_vs_untimed_min']:.3f}-"
        f"{figures['timed_vs_untimed_max']:.3f})"
    )
    results_log.record("stage_timings", figures, run, enabled=not args.no_record)
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
