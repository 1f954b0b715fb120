"""The dynamic-sampling ablation's table and plot in docs/training.md, from
`scripts/results/dynamic_sampling_ablation.jsonl` (one line per task and seed, written by
`scripts/experiments/ablate_dynamic_sampling.py`).

Per task and seed the table uses the newest line recorded with the shipped budget and evaluation (no `--max-steps`,
no `--num-eval`) and the newest line's `max_rounds`, so a re-run replaces the old seeds instead of mixing with them.
`dynamic_sampling_ablation.png` is redrawn from the same lines. `scripts/render/render_figures.py` calls `blocks`
and `draw`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # render_quickstart, when imported by a test
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # results_log: where every run is recorded
import results_log  # noqa: E402
from render_quickstart import _count, _pct, _provenance, _stats  # noqa: E402  (the seed tables' own formatting)

BENCHMARK = "dynamic_sampling_ablation"
PLOT = f"{BENCHMARK}.png"
COMMAND = "python scripts/experiments/ablate_dynamic_sampling.py --tasks emerge,multiturn --seeds 0-4"
ARMS = ("baseline", "dynamic")


def chosen(directory: Path) -> dict[str, list[tuple[int, dict]]]:
    """Per task, (line number, line) of the newest full-budget line per seed with the newest `max_rounds`."""
    lines = [
        (n, line)
        for n, line in enumerate(results_log.read(BENCHMARK, directory), 1)
        if "max_steps" not in line and "num_eval" not in line  # the shipped budget and evaluation only
    ]
    by_task: dict[str, dict[int, tuple[int, dict]]] = {}
    rounds = lines[-1][1]["max_rounds"] if lines else None
    for n, line in lines:
        if line["max_rounds"] == rounds:
            by_task.setdefault(line["task"], {})[line["seed"]] = (n, line)
    return {task: [seeds[s] for s in sorted(seeds)] for task, seeds in by_task.items()}


ROWS = (
    ("held-out accuracy after", "accuracy_after", _pct),
    ("held-out code ratio after", "code_ratio_after", _pct),
    ("training samples' code use passed 50% at step", "steps_to_half_code", _count),
    ("... after this many samples generated", "samples_to_half_code", _count),
    ("steps trained", "steps", _count),
    ("samples generated", "samples", _count),
    ("steps that hit the cap", "capped_steps", _count),
    ("training time (s)", "train_s", _count),
)


def table(by_task: dict[str, list[tuple[int, dict]]]) -> str:
    seeds = sorted({line["seed"] for lines in by_task.values() for _, line in lines})
    out = ["| task | arm | figure | mean | min | max | " + " | ".join(f"seed {s}" for s in seeds) + " |"]
    out.append("|---" * (6 + len(seeds)) + "|")
    for task, lines in by_task.items():
        per_seed = {line["seed"]: line for _, line in lines}
        for label, key, show in ROWS:
            for arm in ARMS:
                values = [per_seed[s]["arms"][arm].get(key) if s in per_seed else None for s in seeds]
                cells = [show(v) for v in _stats(values) + values]
                out.append(f"| {task} | {arm} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def blocks(directory: Path) -> dict[str, str]:
    by_task = chosen(directory)
    if not by_task:
        return {BENCHMARK: f"No run recorded yet: run `{COMMAND}`."}
    rounds = next(iter(by_task.values()))[0][1]["max_rounds"]
    head = (
        f"`dynamic_sampling_max_rounds` {rounds}; every arm stops at the baseline's budget of generated samples.\n\n"
    )
    used = [entry for lines in by_task.values() for entry in lines]
    source = _provenance(used, BENCHMARK, name=lambda line: f"{line['task']}, seed {line['seed']}")
    return {BENCHMARK: head + table(by_task) + "\n\n" + source}


def draw(directory: Path) -> Path | None:
    """Training code ratio and accuracy against samples generated, per task, every seed, both arms."""
    by_task = chosen(directory)
    if not by_task:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from retool_trl.reporting.plotting import save_figure

    fig, axes = plt.subplots(len(by_task), 2, figsize=(11, 3.3 * len(by_task)), squeeze=False)
    for row, (task, lines) in enumerate(by_task.items()):
        for column, (key, title) in enumerate((("step_code_ratio", "code use"), ("step_accuracy", "accuracy"))):
            ax = axes[row][column]
            for index, arm in enumerate(ARMS):
                for n, (_, line) in enumerate(lines):
                    figures = line["arms"][arm]
                    points = [(s / 1000, v) for s, v in zip(figures["step_samples"], figures[key]) if v is not None]
                    if points:
                        label = f"{arm} ({len(lines)} seeds)" if n == 0 else None
                        ax.plot(*zip(*points), color=f"C{index}", linewidth=1.0, alpha=0.75, label=label)
            ax.set_title(f"{task}: {title} of the samples generated at each step", fontsize=10)
            ax.set_xlabel("samples generated (thousands)")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="lower right")
    last = next(iter(by_task.values()))[-1][1]["run"]
    fig.suptitle("GRPO with and without dynamic sampling, same budget of generated samples", fontsize=11)
    fig.text(0.5, 0.005, f"{COMMAND} on CPU, {last.get('cpu_count')} cores (from {BENCHMARK}.jsonl)", ha="center")
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    path = directory / PLOT
    save_figure(fig, path, layout=False)
    return path
