"""The quickstart over several seeds: one run folder per seed, then a table (mean, min, max) and one plot across them.

A single seed's accuracy is a draw (each seed changes the problems, the samples and the training trajectory); the
figures this package reports for its quickstarts are the mean and the minimum over seeds, from [`run_seeds`]
(`retool-trl quickstart --seeds 0-4`).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from .plan import RUNS

# (summary key under a run, label, kind): what the table reports for each run, when the task logs it. The kind is
# True for a rate (shown in %), False for a mean (two decimals), None for a count.
REPORTED = (
    ("accuracy_before", "accuracy before", True),
    ("accuracy_after", "accuracy after", True),
    ("code_ratio_before", "code ratio before", True),
    ("code_ratio_after", "code ratio after", True),
    ("step_code_ratio_passed_50", "training samples' code ratio passed 50% at step", None),
    ("calls_per_completion_after", "calls per completion after", False),
    ("recovery_rate_before", "recovery before", True),
    ("recovery_rate_after", "recovery after", True),
    ("failing_completions_after", "completions with a failing cell after", None),
    ("recovery_probe_before", "recovery probe before", True),
    ("recovery_probe_after", "recovery probe after", True),
    ("recovery_probe_stderr_after", "recovery probe after, standard error", True),
    ("recovery_probe_n", "recovery probe completions", None),
)


def parse_seeds(text: str) -> list[int]:
    """Seeds from `0-4`, `0,2,7` or `3` (ranges inclusive).

    Raises:
        ValueError: The text is not such a list.
    """
    seeds = []
    try:
        for part in str(text).split(","):
            first, dash, last = part.strip().partition("-")
            first, last = int(first), int(last if dash else first)
            if last < first:
                raise ValueError
            seeds.extend(range(first, last + 1))
    except ValueError:
        raise ValueError(f"--seeds {text!r} is not a list of seeds: write e.g. 0-4 or 0,2,7.") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"--seeds {text!r} must name distinct seeds >= 0, e.g. 0-4.")
    return seeds


def run_seeds(seeds: list[int], run, output_dir: str | Path = "retool_quickstart", **kwargs) -> dict:
    """Runs one quickstart per seed into `output_dir/seed{N}/`, then writes
    `output_dir/seeds.json` (every seed's figures with their mean, min and max), `seeds.md` (the table) and
    `seeds.png` (the figures per seed).

    Args:
        seeds (`list[int]`): The seeds.
        run (`Callable`): One seed's quickstart, `run(output_dir, seed=..., **kwargs) -> summary`
            ([`~retool_trl.quickstart.run_quickstart`]).
        output_dir (`str` or `Path`): Parent folder of the seeds' run folders.
        kwargs: Other `QuickstartArguments` fields, the same for every seed.

    Returns:
        The aggregate (as written to `seeds.json`).
    """
    out = Path(output_dir)
    started = time.perf_counter()
    summaries = {}
    for k, seed in enumerate(seeds, 1):
        print(f"\n######## seed {seed} ({k} of {len(seeds)}) ########", flush=True)
        summaries[seed] = run(out / f"seed{seed}", seed=seed, **kwargs)
    aggregate = aggregate_seeds(summaries)
    aggregate["wall_s"] = round(time.perf_counter() - started, 1)
    (out / "seeds.json").write_text(json.dumps(aggregate, indent=2) + "\n")
    table = seeds_table(aggregate)
    (out / "seeds.md").write_text(table + "\n")
    if "step_code_ratio" in summaries[seeds[0]]["tool_rl"]:  # a task that records per-step curves (emerge)
        from .emerge import plot_emergence

        task = kwargs.get("task", "arithmetic")
        plot = plot_emergence(
            summaries,
            out / "seeds.png",
            f"{task} quickstart over {len(seeds)} seeds: tool_rl vs text_rl from the same checkpoint",
            f"retool-trl quickstart --task {task} --seeds {_span(seeds)} on CPU, {os.cpu_count()} cores",
        )
    else:
        plot = plot_seeds(aggregate, out / "seeds.png")
    print("\n" + table)
    print(f"\n{len(seeds)} seeds in {aggregate['wall_s']:.0f} s; wrote {out / 'seeds.json'}, seeds.md and {plot.name}")
    return aggregate


def _span(seeds: list[int]) -> str:
    """`0-4` for consecutive seeds, else `0,2,7`."""
    if seeds == list(range(seeds[0], seeds[-1] + 1)) and len(seeds) > 1:
        return f"{seeds[0]}-{seeds[-1]}"
    return ",".join(map(str, seeds))


def _stats(values: list) -> dict:
    present = [v for v in values if v is not None]
    if not present:
        return {"mean": None, "min": None, "max": None}
    return {"mean": sum(present) / len(present), "min": min(present), "max": max(present)}


def aggregate_seeds(summaries: dict[int, dict]) -> dict:
    """Per run and figure: the value of each seed, and their mean, min and max (from each seed's `summary.json`).

    Rates drawn from few completions (recovery) also get each seed's standard error, `sqrt(p(1-p)/n)`.
    """
    seeds = sorted(summaries)
    first = summaries[seeds[0]]
    result = {"seeds": seeds, "task": first.get("task"), "settings": first.get("settings"), "runs": {}}
    for run in RUNS:
        figures = {}
        for key, _, _ in REPORTED:
            if key not in first[run]:
                continue
            values = [summaries[s][run].get(key) for s in seeds]
            figures[key] = {"per_seed": values, **_stats(values)}
        if "recovery_rate_after" in first[run]:
            figures["recovery_rate_after"]["stderr_per_seed"] = [
                _stderr(
                    summaries[s][run].get("recovery_rate_after"), summaries[s][run].get("failing_completions_after")
                )
                for s in seeds
            ]
        result["runs"][run] = figures
    walls = [summaries[s]["wall_s"] for s in seeds]
    result["command_s"] = {"per_seed": walls, **_stats(walls)}
    return result


def _stderr(rate, count) -> float | None:
    if rate is None or not count:
        return None
    return math.sqrt(rate * (1 - rate) / count)


def seeds_table(aggregate: dict) -> str:
    """A Markdown table: one row per run and figure, with mean, min, max and every seed's value."""
    seeds = aggregate["seeds"]
    header = ["run", "figure", "mean", "min", "max", *(f"seed {s}" for s in seeds)]
    rows = [header, ["---"] * len(header)]
    lines = [
        (run, label, is_rate, figures[key])
        for run, figures in aggregate["runs"].items()
        for key, label, is_rate in REPORTED
        if key in figures
    ]
    lines.append(("both", "whole command (s)", None, aggregate["command_s"]))
    for run, label, is_rate, fig in lines:

        def show(value, is_rate=is_rate):
            if value is None:
                return "-"
            return f"{value:.1%}" if is_rate else (f"{value:.0f}" if is_rate is None else f"{value:.2f}")

        rows.append([run, label, *(show(fig[s]) for s in ("mean", "min", "max")), *map(show, fig["per_seed"])])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def plot_seeds(aggregate: dict, path: str | Path) -> Path:
    """One figure across seeds: held-out accuracy before and after per run, and the task's other rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds, runs = aggregate["seeds"], aggregate["runs"]
    extra = [k for k in ("code_ratio_after", "recovery_rate_after") if k in runs["tool_rl"]]
    fig, axes = plt.subplots(1, 1 + len(extra), figsize=(5.2 * (1 + len(extra)), 4.2), squeeze=False)
    x = list(range(len(seeds)))
    ax = axes[0][0]
    colors = {"tool_rl": "tab:blue", "text_rl": "tab:orange"}
    for shift, (run, figures) in zip((-0.08, 0.08), runs.items()):
        before, after = figures["accuracy_before"]["per_seed"], figures["accuracy_after"]["per_seed"]
        xs = [i + shift for i in x]
        ax.scatter(xs, [100 * v for v in before], marker="o", facecolors="none", edgecolors=colors[run])
        ax.scatter(xs, [100 * v for v in after], marker="o", color=colors[run], label=f"{run} after")
        for i, b, a in zip(xs, before, after):
            ax.annotate("", (i, 100 * a), (i, 100 * b), arrowprops={"arrowstyle": "->", "color": colors[run]})
        ax.axhline(100 * figures["accuracy_after"]["mean"], color=colors[run], lw=0.8, ls=":")
    ax.set_title("held-out accuracy (open: before, filled: after; dotted: mean after)", fontsize=9)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(-3, 103)
    ax.legend(fontsize=8, loc="center right")
    for ax, key in zip(axes[0][1:], extra):
        fig_ = runs["tool_rl"][key]
        values = [None if v is None else 100 * v for v in fig_["per_seed"]]
        errors = [0 if e is None else 100 * e for e in fig_.get("stderr_per_seed", [0] * len(seeds))]
        ax.errorbar(x, [v if v is not None else float("nan") for v in values], yerr=errors, fmt="o", capsize=3)
        label = key.replace("_after", "").replace("_", " ")
        ax.set_title(
            f"tool_rl {label} after" + (" (± standard error)" if "stderr_per_seed" in fig_ else ""), fontsize=9
        )
        ax.set_ylabel(f"{label} (%)")
        ax.set_ylim(-3, 103)
    for ax in axes[0]:
        ax.set_xticks(x, [str(s) for s in seeds])
        ax.set_xlabel("seed")
        ax.grid(alpha=0.3)
    task = aggregate.get("task") or {}
    name = "multi-turn" if "max_cell_chars" in task else "arithmetic"
    fig.suptitle(f"{name} quickstart over {len(seeds)} seeds", fontsize=11)
    command = f"retool-trl quickstart{' --task multiturn' if name == 'multi-turn' else ''} --seeds {_span(seeds)}"
    fig.text(0.01, 0.01, f"{command} on CPU, {os.cpu_count()} cores", fontsize=7, color="0.35")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
