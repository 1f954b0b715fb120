"""Ablation of ReToolConfig's stability options on the CPU quickstart task (same seeds, same budget).

Runs tool-RL from the shipped checkpoint once per variant (the paper's baseline, then each option alone), evaluates
on the held-out split before/after at the sampling temperature, and prints a table: held-out accuracy, code ratio,
turns per completion, mean length, and collapse (the logged code ratio falling below half its starting value).
Writes `ablation.json` and `ablation.png` (code ratio and reward over steps) to the output folder.

    python scripts/experiments/ablate_stability.py [--output-dir runs/ablation] [--max-steps 40] [--variants
    baseline,roc_x2]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

VARIANTS = {
    "baseline": {},
    "void_filter": {"filter_void_turns": True},
    "roc_x2": {"roc_oversample": 2},
    "tool_bonus_0.1": {"tool_use_bonus": 0.1},
    "truncate_tail": {"interpreter_truncation": "tail"},
}


def summarize(result: dict) -> dict:
    history = [h for h in result["log_history"] if "retool/code_ratio" in h]
    ratios = [h["retool/code_ratio"] for h in history]
    last = history[-1] if history else {}
    return {
        "accuracy_before": result["accuracy_before"],
        "accuracy_after": result["accuracy_after"],
        "code_ratio_after": result["code_ratio_after"],
        "turns_per_completion": last.get("retool/turns_per_completion"),
        "mean_length_after": result["mean_length_after"],
        "min_train_code_ratio": min(ratios) if ratios else None,
        "collapse": bool(ratios) and min(ratios) < ratios[0] / 2,
        "train_s": result["train_s"],
    }


def plot(histories: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from retool_trl.reporting.plotting import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for index, (name, history) in enumerate(histories.items()):
        for ax, key in zip(axes, ("retool/code_ratio", "reward")):
            points = [(h["step"], h[key]) for h in history if key in h]
            ax.plot(*zip(*points), label=name, color=f"C{index}", linewidth=1.3)
    for ax, title in zip(axes, ("code ratio (training samples)", "reward")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    save_figure(fig, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="runs/ablation")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--num-eval", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    options = parser.parse_args()

    from transformers import AutoTokenizer

    from retool_trl.quickstart import QuickstartArguments, arithmetic_plan, rl_config, train_run
    from retool_trl.sandbox.factory import sandbox_from_config

    names = options.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    args = QuickstartArguments(
        output_dir=options.output_dir, max_steps=options.max_steps, num_eval=options.num_eval, seed=options.seed
    )
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = arithmetic_plan(args)  # the quickstart's problems and shipped model
    start, splits = plan.model, plan.splits
    tokenizer = AutoTokenizer.from_pretrained(start, padding_side="left")
    sandbox = sandbox_from_config(rl_config(args, out, with_tools=True))
    started = time.perf_counter()
    results, histories = {}, {}
    try:
        for name in names:
            result = train_run(name, args, start, tokenizer, splits, sandbox, out, with_tools=True, **VARIANTS[name])
            histories[name] = result["log_history"]
            results[name] = summarize(result)
    finally:
        sandbox.close()

    header = (
        f"{'variant':<16}{'acc before':>11}{'acc after':>11}{'code ratio':>11}{'turns':>7}{'length':>8}"
        f"{'collapse':>10}"
    )
    print("\n" + header)
    for name, r in results.items():
        turns = f"{r['turns_per_completion']:.2f}" if r["turns_per_completion"] is not None else "-"
        print(
            f"{name:<16}{r['accuracy_before']:>11.1%}{r['accuracy_after']:>11.1%}{r['code_ratio_after']:>11.1%}"
            f"{turns:>7}{r['mean_length_after']:>8.1f}{('yes' if r['collapse'] else 'no'):>10}"
        )
    plot(histories, out / "ablation.png")
    (out / "ablation.json").write_text(
        json.dumps(
            {"variants": results, "settings": vars(options), "wall_s": round(time.perf_counter() - started, 1)},
            indent=2,
        )
    )
    print(f"\nwrote {out / 'ablation.json'} and {out / 'ablation.png'} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
