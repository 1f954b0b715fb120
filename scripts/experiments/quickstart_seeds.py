#!/usr/bin/env python
"""Runs a CPU quickstart once per seed and records each seed's figures in `scripts/results/quickstart_<task>.jsonl`
(`quickstart_<format>.jsonl` for the arithmetic task in another call format than `tags`).

One JSON line per seed (the run folder's `summary.json` figures: held-out accuracy and code ratio before and after,
the per-step code ratio and accuracy of the training samples, `step_code_ratio_passed_50`, wall time, settings) with
the conditions it was measured under (`results_log`). `scripts/render/render_figures.py` renders the docs' five-seed
tables and plots of the emergence quickstart and of each call format from these lines. Seeds run one after the other.

    python scripts/experiments/quickstart_seeds.py --task emerge --seeds 0-4 [--output-dir runs/emerge_seeds]
    python scripts/experiments/quickstart_seeds.py --task arithmetic --call-format markdown --seeds 0-4
    python scripts/experiments/quickstart_seeds.py --task emerge --seeds 0 --model DIR --label no_code  # a variant
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # results_log: where every run is recorded
import results_log  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

# What a line keeps of a run's summary (the rest stays in the run folder).
KEPT = (
    "accuracy_before",
    "accuracy_after",
    "code_ratio_before",
    "code_ratio_after",
    "mean_length_after",
    "code_start_prob_before",
    "code_start_prob_after",
    "step_code_ratio",
    "step_accuracy",
    "step_code_ratio_passed_50",
    "train_s",
    "steps",
)


def figures_of(summary: dict, seed: int, label: str) -> dict:
    """The results line's figures from one seed's `summary.json`."""
    runs = {run: {k: summary[run][k] for k in KEPT if k in summary[run]} for run in ("tool_rl", "text_rl")}
    settings = {k: v for k, v in summary["settings"].items() if k not in ("output_dir", "seed")}
    return {
        "label": label,
        "seed": seed,
        "model": Path(summary["model"]).name,
        **runs,
        "wall_s": summary["wall_s"],
        "settings": settings,
        "task": summary["task"],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="emerge", help="Quickstart task (default: emerge).")
    parser.add_argument("--seeds", default="0-4", help="Seeds, e.g. 0-4 or 0,2.")
    parser.add_argument("--output-dir", default=None, help="Parent of the seed run folders (default: runs/<task>).")
    parser.add_argument("--model", default=None, help="Starting checkpoint (default: the task's shipped one).")
    parser.add_argument("--label", default="shipped", help="What the line measures ('shipped': the task as shipped).")
    parser.add_argument("--max-steps", type=int, default=None, help="GRPO steps (default: the task's).")
    parser.add_argument(
        "--call-format", default="tags", help="Call format of the arithmetic task: tags, markdown or tool_call."
    )
    results_log.add_arguments(parser)
    args = parser.parse_args(argv)

    from retool_trl.quickstart import run_quickstart
    from retool_trl.quickstart.seeds import parse_seeds

    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    name = args.task if args.call_format == "tags" else args.call_format
    out = Path(args.output_dir or f"runs/{name}")
    options = {"task": args.task}
    if args.call_format != "tags":
        options["call_format"] = args.call_format
    if args.model:
        options["model"] = args.model
    if args.max_steps:
        options["max_steps"] = args.max_steps
    for seed in seeds:
        run = results_log.conditions()
        summary = run_quickstart(out / f"seed{seed}", seed=seed, **options)
        results_log.record(
            f"quickstart_{name}", figures_of(summary, seed, args.label), run, enabled=not args.no_record
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
