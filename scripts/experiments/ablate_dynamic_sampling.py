#!/usr/bin/env python
"""DAPO's dynamic sampling against the same budget of generated samples, on the emergence and multi-turn quickstarts.

Per task and seed, two tool-RL runs start from the task's shipped checkpoint and train side by side, one core each:
`baseline` (the quickstart's tool-RL run as shipped) and `dynamic` (the same with `dynamic_sampling: true`). Both
stop once they have generated the baseline's budget of completions (`max_steps` x problems per step x samples per
problem): a dynamic step that needs three rollout rounds spends three steps' worth, so the dynamic run takes fewer,
better-filled steps. Each run is then evaluated on the task's held-out problems at the sampling temperature.

One JSON line per task and seed goes to `scripts/results/dynamic_sampling_ablation.jsonl`: per arm the held-out
accuracy and code ratio after training, the steps and samples it took, when the training samples' code use first
passed 50% (in steps and in samples), the training wall time, and the per-step curves; with the conditions they were
measured under (`results_log`). `scripts/render/render_figures.py` renders the table in docs/training.md and
`dynamic_sampling_ablation.png` from these lines.

    python scripts/experiments/ablate_dynamic_sampling.py [--tasks emerge,multiturn] [--seeds 0-4]
        [--output-dir runs/dynamic_sampling_ablation] [--max-rounds 3] [--max-steps N] [--num-eval N] [--no-record]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # results_log: where every run is recorded
import results_log  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

BENCHMARK = "dynamic_sampling_ablation"
ARMS = ("baseline", "dynamic")
TASKS = ("emerge", "multiturn")


ROUNDS = "retool/dynamic_sampling/rounds"


def budget_callback(budget: int, generation_batch: int):
    """A `TrainerCallback` that stops training once `budget` completions have been generated: each logged step
    generated `retool/dynamic_sampling/rounds` generation batches (one without dynamic sampling). It counts per
    step, so it needs one log per step and one step per generation batch, and refuses other settings."""
    from transformers import TrainerCallback

    class SampleBudget(TrainerCallback):
        def __init__(self):
            self.generated = 0

        def on_train_begin(self, args, state, control, **kwargs):
            per_step = (args.logging_steps, args.steps_per_generation, args.num_iterations)
            if per_step != (1, 1, 1):
                raise ValueError(
                    "the sample budget counts one generation batch per logged step: it needs logging_steps=1, "
                    f"steps_per_generation=1 and num_iterations=1, got {per_step}"
                )

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "reward" not in logs:  # the end-of-training summary, not a step
                return
            if args.dynamic_sampling and ROUNDS not in logs:
                raise RuntimeError(f"dynamic sampling is on but the step logged no {ROUNDS}: cannot count samples")
            self.generated += round(logs.get(ROUNDS, 1.0)) * generation_batch
            logs["retool/samples_generated"] = self.generated  # the run's log.jsonl, written from these logs
            state.log_history[-1]["retool/samples_generated"] = self.generated  # trainer_state.json's entry
            if self.generated >= budget:
                control.should_training_stop = True

    return SampleBudget()


def curves(log_history: list[dict]) -> dict:
    """Per training step: samples generated so far, code ratio and accuracy of what was generated, rounds, capped."""
    steps = [h for h in log_history if "reward" in h and "retool/samples_generated" in h]
    return {
        "step_samples": [h["retool/samples_generated"] for h in steps],
        "step_code_ratio": [h.get("retool/code_ratio") for h in steps],
        "step_accuracy": [h.get("retool/accuracy") for h in steps],
        "step_zero_std": [h.get("frac_reward_zero_std") for h in steps],
        "step_rounds": [h.get(ROUNDS, 1.0) for h in steps],
        "step_capped": [h.get("retool/dynamic_sampling/capped", 0.0) for h in steps],
    }


def tryout(options) -> dict:
    """The `QuickstartArguments` a try-out run sets (`--max-steps`, `--num-eval`); the task's own where unset."""
    return {k: v for k, v in (("max_steps", options.max_steps), ("num_eval", options.num_eval)) if v}


def run_arm(task: str, seed: int, arm: str, out: Path, options) -> dict:
    """One arm of one seed (run in its own process): train, evaluate after, return its figures."""
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    from retool_trl.quickstart import QuickstartArguments, rl_config, train_run
    from retool_trl.quickstart.emerge import passed_half
    from retool_trl.quickstart.runner import PLANS
    from retool_trl.sandbox.factory import sandbox_from_config

    started = time.perf_counter()
    make_plan, defaults = PLANS[task]
    args = QuickstartArguments(output_dir=str(out), task=task, seed=seed, **{**defaults, **tryout(options)})
    torch.set_num_threads(args.threads or 1)
    transformers_logging.disable_progress_bar()  # two arms share the console: labelled lines instead of bars
    plan = make_plan(args)
    generation_batch = args.prompts_per_step * args.num_generations
    budget = args.max_steps * generation_batch
    kwargs = {k: v for k, v in plan.run_kwargs.items() if k != "probe"}  # the task's figures, not its probe
    if arm == "dynamic":
        kwargs.update(dynamic_sampling=True, dynamic_sampling_max_rounds=options.max_rounds)
    tokenizer = AutoTokenizer.from_pretrained(plan.model, padding_side="left")
    sandbox = sandbox_from_config(rl_config(args, out, with_tools=True))
    try:
        result = train_run(
            "tool_rl",
            args,
            plan.model,
            tokenizer,
            plan.splits,
            sandbox,
            out,
            with_tools=True,
            console_label=f"{task} seed {seed} {arm}",
            callbacks=[budget_callback(budget, generation_batch)],
            evaluate_before=False,
            **kwargs,
        )
    finally:
        sandbox.close()
    figures = curves(result.pop("log_history"))
    step = passed_half(figures["step_code_ratio"])
    return {
        **{k: v for k, v in result.items() if k.endswith("_after")},
        "steps": result["steps"],
        "samples": figures["step_samples"][-1] if figures["step_samples"] else 0,
        "budget": budget,
        "steps_to_half_code": step,
        "samples_to_half_code": figures["step_samples"][step - 1] if step else None,
        "capped_steps": int(sum(figures["step_capped"])),
        "train_s": result["train_s"],
        "wall_s": round(time.perf_counter() - started, 1),
        **figures,
    }


def run_seed(task: str, seed: int, out: Path, options) -> dict:
    """Both arms of one seed, side by side in two processes; their figures once both are done."""
    children = {}
    for arm in ARMS:
        command = [sys.executable, __file__, "--arm", arm, "--tasks", task, "--seeds", str(seed)]
        command += ["--output-dir", str(out), "--max-rounds", str(options.max_rounds)]
        for field, value in tryout(options).items():
            command += [f"--{field.replace('_', '-')}", str(value)]
        children[arm] = subprocess.Popen(command)
    failed = {}
    try:
        while len(failed) < len(children) and not any(failed.values()):  # a failed arm ends the other at once
            for arm, child in children.items():
                if arm not in failed and child.poll() is not None:
                    failed[arm] = child.returncode
            time.sleep(0.5)
    finally:
        for child in children.values():
            if child.poll() is None:
                child.terminate()
                child.wait()
    failed = {arm: code for arm, code in failed.items() if code}
    if failed:
        raise RuntimeError(f"{task} seed {seed}: arm(s) failed with exit codes {failed}; see the output above")
    return {arm: json.loads((out / arm / "result.json").read_text()) for arm in ARMS}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TASKS), help="Comma list of quickstart tasks (emerge, multiturn).")
    parser.add_argument("--seeds", default="0-4", help="Seeds, e.g. 0-4 or 0,2.")
    parser.add_argument("--output-dir", default="runs/dynamic_sampling_ablation", help="Parent of the run folders.")
    parser.add_argument("--max-rounds", type=int, default=3, help="dynamic_sampling_max_rounds of the dynamic arm.")
    parser.add_argument("--max-steps", type=int, default=None, help="Baseline steps, the budget (default: task's).")
    parser.add_argument("--num-eval", type=int, default=None, help="Held-out problems (default: the task's).")
    parser.add_argument("--arm", choices=ARMS, default=None, help=argparse.SUPPRESS)  # one arm, in its own process
    results_log.add_arguments(parser)
    options = parser.parse_args(argv)

    from retool_trl.quickstart.seeds import parse_seeds

    tasks = options.tasks.split(",")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        parser.error(f"unknown task(s) {unknown}; choose from {list(TASKS)}")
    try:
        seeds = parse_seeds(options.seeds)
    except ValueError as error:
        parser.error(str(error))
    if options.arm:  # a child: one task, one seed, one arm
        out = Path(options.output_dir)
        figures = run_arm(tasks[0], seeds[0], options.arm, out / options.arm, options)
        (out / options.arm / "result.json").write_text(json.dumps(figures) + "\n")
        return 0
    for task in tasks:
        for seed in seeds:
            run = results_log.conditions()
            out = Path(options.output_dir) / task / f"seed{seed}"
            arms = run_seed(task, seed, out, options)
            line = {"task": task, "seed": seed, "max_rounds": options.max_rounds, "arms": arms}
            line.update(tryout(options))
            results_log.record(BENCHMARK, line, run, enabled=not options.no_record)
            print(
                f"{task} seed {seed}: "
                + "; ".join(
                    f"{arm} accuracy {a['accuracy_after']:.1%} after {a['steps']} steps / {a['samples']} samples, "
                    f"code 50% at step {a['steps_to_half_code']}, {a['train_s']:.0f} s"
                    for arm, a in arms.items()
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
