"""The quickstarts' seed tables and plots in docs/quickstart.md, from `scripts/results/quickstart_<name>.jsonl`:
the emergence quickstart (`quickstart_emerge`) and the arithmetic quickstart in each call format other than `tags`
(`quickstart_markdown`, `quickstart_tool_call`).

`scripts/experiments/quickstart_seeds.py` appends one line per seed. A table uses, per seed, the newest line labelled
`shipped` measured with the same settings as the newest such line (so a re-tuned recipe replaces the old seeds
instead of mixing with them); the emergence no-code control is the newest `no_code` line per seed. Each plot
(`<benchmark>_seeds.png`, the same drawing as the emergence run folder's) is redrawn from the same lines.
`scripts/render/render_figures.py` calls `blocks` and `draw`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # results_log: where every run is recorded
import results_log  # noqa: E402

BENCHMARK = "quickstart_emerge"
PLOT = "quickstart_emerge_seeds.png"
COMMAND = "python scripts/experiments/quickstart_seeds.py --task emerge --seeds 0-4"
# The arithmetic quickstart in the other call formats: benchmark -> (call format, the command that records it).
FORMATS = {
    f"quickstart_{name}": (
        name,
        f"python scripts/experiments/quickstart_seeds.py --task arithmetic --call-format {name} --seeds 0-4",
    )
    for name in ("markdown", "tool_call")
}


def _chosen(directory: Path, label: str, benchmark: str = BENCHMARK) -> list[tuple[int, dict]]:
    """(line number, line) of the newest line per seed with `label`, all measured with the newest one's settings."""
    lines = [(n, line) for n, line in enumerate(results_log.read(benchmark, directory), 1) if line["label"] == label]
    if not lines:
        return []
    settings = lines[-1][1]["settings"]
    newest = {line["seed"]: (n, line) for n, line in lines if line["settings"] == settings}
    return [newest[s] for s in sorted(newest)]


def _pct(value) -> str:
    return "-" if value is None else f"{value:.1%}"


def _prob(value) -> str:
    return "-" if value is None else f"{value:.1e}"


def _count(value) -> str:
    return "-" if value is None else f"{value:.0f}"


ROWS = (
    ("tool_rl", "held-out accuracy before", "accuracy_before", _pct),
    ("tool_rl", "held-out accuracy after", "accuracy_after", _pct),
    ("tool_rl", "held-out code ratio before", "code_ratio_before", _pct),
    ("tool_rl", "held-out code ratio after", "code_ratio_after", _pct),
    ("tool_rl", "P(first token is code), held-out prompts, before", "code_start_prob_before", _prob),
    ("tool_rl", "P(first token is code), held-out prompts, after", "code_start_prob_after", _prob),
    ("tool_rl", "training samples' code ratio passed 50% at step", "step_code_ratio_passed_50", _count),
    ("text_rl", "held-out accuracy before", "accuracy_before", _pct),
    ("text_rl", "held-out accuracy after", "accuracy_after", _pct),
    ("text_rl", "held-out code ratio after (calls run; none can)", "code_ratio_after", _pct),
    ("text_rl", "P(first token is code), held-out prompts, after", "code_start_prob_after", _prob),
)


FORMAT_ROWS = (
    ("tool_rl", "held-out accuracy before", "accuracy_before", _pct),
    ("tool_rl", "held-out accuracy after", "accuracy_after", _pct),
    ("tool_rl", "held-out code ratio before", "code_ratio_before", _pct),
    ("tool_rl", "held-out code ratio after", "code_ratio_after", _pct),
    ("text_rl", "held-out accuracy before", "accuracy_before", _pct),
    ("text_rl", "held-out accuracy after", "accuracy_after", _pct),
    ("text_rl", "held-out code ratio after (calls run; none can)", "code_ratio_after", _pct),
    ("tool_rl", "training time (s)", "train_s", _count),
    ("text_rl", "training time (s)", "train_s", _count),
    (None, "whole command, both runs (s)", "wall_s", _count),
)


def _provenance(
    chosen: list[tuple[int, dict]], benchmark: str = BENCHMARK, name=lambda line: f"seed {line['seed']}"
) -> str:
    """The source line under a table: per line used, its number, what it is (`name(line)`) and its conditions."""
    notes = []
    for n, line in chosen:
        run = line["run"]
        load = run.get("load_avg_before")
        where = f"line {n} ({name(line)}): {run.get('date', '')[:10]}, commit {run.get('commit') or 'unknown'}"
        if run.get("dirty"):
            where += " (with uncommitted changes)"
        where += f", {run.get('cpu_count')} CPUs, load average before {load[0]:.1f}" if load else ""
        after = run.get("load_avg_after")
        where += f", after {after[0]:.1f}" if load and after else ""
        notes.append(where)
    return f"Source: `scripts/results/{benchmark}.jsonl`, " + "; ".join(notes) + "."


def _stats(values) -> list:
    """Mean, min and max of the values present (`None` three times when there are none)."""
    present = [v for v in values if v is not None]
    return [sum(present) / len(present), min(present), max(present)] if present else [None] * 3


def _table(chosen: list[tuple[int, dict]], rows) -> str:
    seeds = [line["seed"] for _, line in chosen]
    out = ["| run | figure | mean | min | max | " + " | ".join(f"seed {s}" for s in seeds) + " |"]
    out.append("|---" * (5 + len(seeds)) + "|")
    for run, label, key, show in rows:
        values = [line[run].get(key) if run else line.get(key) for _, line in chosen]
        out.append(f"| {run or 'both'} | {label} | " + " | ".join(show(v) for v in _stats(values) + values) + " |")
    return "\n".join(out)


def blocks(directory: Path) -> dict[str, str]:
    """`quickstart_emerge` (the five-seed table) and `quickstart_emerge_no_code` (the control)."""
    shipped = _chosen(directory, "shipped")
    rendered = {}
    if shipped:
        rows = (*ROWS, (None, "whole command, both runs (s)", "wall_s", _count))
        rendered[BENCHMARK] = _table(shipped, rows) + "\n\n" + _provenance(shipped)
    else:
        rendered[BENCHMARK] = f"No run recorded yet: run `{COMMAND}`."
    control = _chosen(directory, "no_code")
    if control:
        rows = (
            ("tool_rl", "held-out code ratio before", "code_ratio_before", _pct),
            ("tool_rl", "held-out code ratio after", "code_ratio_after", _pct),
            ("tool_rl", "P(first token is code), held-out prompts, before", "code_start_prob_before", _prob),
            ("tool_rl", "P(first token is code), held-out prompts, after", "code_start_prob_after", _prob),
            ("tool_rl", "held-out accuracy after", "accuracy_after", _pct),
            ("tool_rl", "training samples' code ratio passed 50% at step", "step_code_ratio_passed_50", _count),
        )
        highest = max(max(line["tool_rl"]["step_code_ratio"]) for _, line in control)
        rendered[f"{BENCHMARK}_no_code"] = (
            _table(control, rows)
            + f"\n\nHighest code ratio of the training samples at any step: {highest:.1%}.\n\n"
            + _provenance(control)
        )
    else:
        rendered[f"{BENCHMARK}_no_code"] = "No no-code control recorded yet."
    for benchmark, (_, command) in FORMATS.items():
        chosen = _chosen(directory, "shipped", benchmark)
        rendered[benchmark] = (
            _table(chosen, FORMAT_ROWS) + "\n\n" + _provenance(chosen, benchmark)
            if chosen
            else f"No run recorded yet: run `{command}`."
        )
    return rendered


def draw_formats(directory: Path) -> list[Path]:
    """Redraws each call format's `<benchmark>_seeds.png` from its chosen `shipped` lines (those recorded)."""
    from retool_trl.quickstart.emerge import plot_emergence

    drawn = []
    for benchmark, (name, command) in FORMATS.items():
        shipped = _chosen(directory, "shipped", benchmark)
        if not shipped:
            continue
        seeds = [line["seed"] for _, line in shipped]
        steps = shipped[-1][1]["settings"].get("max_steps")
        drawn.append(
            plot_emergence(
                {line["seed"]: line for _, line in shipped},
                directory / f"{benchmark}_seeds.png",
                f"arithmetic quickstart, call format {name}, seeds {','.join(map(str, seeds))}: tool_rl vs text_rl "
                f"from the same checkpoint ({steps} GRPO steps each)",
                f"{command} on CPU, {shipped[-1][1]['run'].get('cpu_count')} cores (from {benchmark}.jsonl)",
            )
        )
    return drawn


def draw(directory: Path) -> Path | None:
    """Redraws `PLOT` from the chosen `shipped` lines (nothing when there are none), and each call format's plot
    ([`draw_formats`])."""
    from retool_trl.quickstart.emerge import plot_emergence

    draw_formats(directory)
    shipped = _chosen(directory, "shipped")
    if not shipped:
        return None
    seeds = [line["seed"] for _, line in shipped]
    steps = shipped[-1][1]["settings"].get("max_steps")
    return plot_emergence(
        {line["seed"]: line for _, line in shipped},
        directory / PLOT,
        f"emergence quickstart, seeds {','.join(map(str, seeds))}: tool_rl vs text_rl from the same checkpoint "
        f"({steps} GRPO steps each)",
        f"{COMMAND} on CPU, {shipped[-1][1]['run'].get('cpu_count')} cores (from {BENCHMARK}.jsonl)",
    )
