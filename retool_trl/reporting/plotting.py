"""Plots of training runs (TRL's `log_history`) as PNG: the panels a ReTool user watches, readable without a README.

Each panel has a title, a y-axis label with its unit, and one line per run (and per series: accuracy with and without
code, error and timeout rates). Noisy per-step values (a rate over a few completions swings by tens of points) are
drawn faint, with a rolling mean over them; panels whose values never change are left out; evaluation values
(`eval_<key>`) are markers. The quickstart's held-out accuracy before and after training is drawn as two labelled
markers, not as a line (two points are not a trend).
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .run_logs import accuracy_of, find_runs, load_log_history, read_run_info, series
from .stage_plot import STAGE_KEYS, draw_stages

# Re-exported: `load_log_history` lived here first.
__all__ = [
    "ARITHMETIC_PANELS",
    "Panel",
    "RUN_PANELS",
    "load_log_history",
    "plot_comparison",
    "plot_log_history",
    "plot_run",
    "plot_runs",
    "save_figure",
]


@dataclass(frozen=True)
class Panel:
    """One panel: a title, a y-axis label (with the unit), and its series.

    Args:
        title (`str`): What the panel shows.
        ylabel (`str`): The y axis, with its unit.
        lines (`tuple`): `(label, logged key, transform)` per series; with key `None`, `transform(log entry)` gives
            the value (e.g. `accuracy_of`).
        percent (`bool`): Values are fractions, shown in %.
        held_out (`str`, *optional*): The quickstart summary's metric drawn as before/after markers.
        sft (`bool`): Drawn only for runs without a reward (SFT); a GRPO loss says little.
        stacked (`bool`): The series are parts of a whole, stacked (one run per panel: `run`).
        run (`str`, *optional*): The one run a stacked panel draws.
    """

    title: str
    ylabel: str
    lines: tuple
    percent: bool = False
    held_out: str | None = None
    sft: bool = False
    stacked: bool = False
    run: str | None = None


def _line(label: str, key: str | None, transform: Callable | None = None) -> tuple:
    return (label, key, transform)


# The panels of `retool-trl plot`, in order; a panel is drawn when one of its keys was logged and changed.
RUN_PANELS = (
    Panel("reward", "reward per completion (mean)", (_line("", "reward"),)),
    Panel(
        "accuracy",
        "correct completions (%)",
        (
            _line("all", None, accuracy_of),
            _line("with code", "retool/accuracy_with_code"),
            _line("without code", "retool/accuracy_without_code"),
        ),
        percent=True,
        held_out="accuracy",
    ),
    Panel("code ratio", "completions that call code (%)", (_line("", "retool/code_ratio"),), True, "code_ratio"),
    Panel(
        "interpreter calls",
        "calls per completion",
        (_line("", "retool/calls_per_completion"),),
        held_out="calls_per_completion",
    ),
    Panel(
        "code errors and timeouts",
        "code calls (%)",
        (_line("error", "retool/error_rate"), _line("timeout", "retool/timeout_rate")),
        percent=True,
    ),
    Panel(
        "recovery from a failing cell",
        "correct after a failing cell (%)",
        (_line("", "retool/recovery_rate"),),
        percent=True,
        held_out="recovery_rate",
    ),
    Panel(  # TRL counts the model's tokens only (interpreter output excluded)
        "completion length",
        "model tokens per completion",
        (_line("all", "completions/mean_length"), _line("finished", "completions/mean_terminated_length")),
        held_out="mean_model_tokens",
    ),
    Panel("interpreter output", "completion tokens (%)", (_line("", "retool/interpreter_token_fraction"),), True),
    Panel("KL to the reference model", "KL (nats per token)", (_line("", "kl"),)),
    Panel("entropy", "entropy (nats per token)", (_line("", "entropy"),)),
    Panel("loss", "cross-entropy (nats per token)", (_line("", "loss"),), sft=True),
    Panel("token accuracy", "next-token accuracy (%)", (_line("", "mean_token_accuracy"),), True),
    Panel(
        "where a step's time goes",
        "seconds per step",
        tuple(_line("", key) for key in (*STAGE_KEYS, "retool/time/step")),
        stacked=True,
    ),
)

# The quickstart's panels (one row); accuracy and calls get the held-out before/after markers.
ARITHMETIC_PANELS = (
    Panel("reward", "reward per completion (mean)", (_line("", "reward"),)),
    Panel("accuracy", "correct completions (%)", (_line("train samples", None, accuracy_of),), True, "accuracy"),
    Panel("code ratio", "completions that call code (%)", (_line("", "retool/code_ratio"),), True, "code_ratio"),
    Panel(
        "completion length",
        "model tokens per completion",
        (_line("", "completions/mean_length"),),
        held_out="mean_model_tokens",
    ),
)


def _rolling(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values (the first points average what there is)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _window(n: int) -> int:
    """Points of the rolling mean: none for short runs, about a tenth of the run otherwise."""
    return 1 if n < 15 else max(3, round(n / 10))


def _panel_series(panel: Panel, history: Sequence[dict]) -> list[tuple[str, list, list]]:
    return [(label, *series(history, key, transform)) for label, key, transform in panel.lines]


def _changes(panel: Panel, histories: Mapping[str, Sequence[dict]]) -> bool:
    """Whether a panel has something to read: values that change, or too few steps to call them flat."""
    series_ = [vs for h in histories.values() for _, _, vs in _panel_series(panel, h) if vs]
    values = [v for vs in series_ for v in vs]
    if not values:
        return False
    return max(values) - min(values) > 1e-9 or max(len(vs) for vs in series_) < 3


def _reward_range(histories: Mapping[str, Sequence[dict]]) -> tuple[float, float] | None:
    """ReTool's +1/-1 when `boxed_accuracy` is the only reward logged (and the means fit in it); `None` (no band)
    when the range cannot be known from the logs."""
    functions = {k.split("/")[1] for h in histories.values() for e in h for k in e if k.startswith("rewards/")}
    means = [v for h in histories.values() for v in series(h, "reward")[1]]
    if functions and functions <= {"boxed_accuracy", "boxed_accuracy_and_recovery"} and means:
        if -1 <= min(means) and max(means) <= 1:
            return -1.0, 1.0
    return None


# A run has the same color in every figure (the quickstart's two runs by name); a single run's other series (with
# and without code, errors and timeouts) take colors no run has.
RUN_COLORS = {"tool_rl": "C0", "text_rl": "C1"}
SERIES_COLORS = ("C2", "C4", "C6")


def run_colors(runs) -> dict[str, str]:
    """The color of each run: the quickstart's runs by name, others the next colors no run has taken."""
    free = iter(c for c in (f"C{i}" for i in range(10)) if c not in RUN_COLORS.values() and c not in SERIES_COLORS)
    return {run: RUN_COLORS.get(run) or next(free, "C9") for run in runs}


def _draw_panel(ax, panel: Panel, histories, colors, evals, reward_range) -> int:
    """Draws one panel; returns the widest rolling window it used (1: none)."""
    if panel.stacked:
        draw_stages(ax, histories[panel.run] if panel.run in histories else next(iter(histories.values())))
        ax.set_title(f"{panel.title}{f' ({panel.run})' if panel.run and len(histories) > 1 else ''}", fontsize=10)
        ax.set_ylabel(panel.ylabel, fontsize=9)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        return 1
    styles, widest, annotated, held_out_span = ("-", "--", ":"), 1, set(), 0
    for run, history in histories.items():
        color = colors[run]
        for index, ((label, steps, values), style) in enumerate(zip(_panel_series(panel, history), styles)):
            if not values:
                continue
            if len(histories) == 1 and index:  # one run: colors tell its series apart, never another run's color
                color = SERIES_COLORS[(index - 1) % len(SERIES_COLORS)]
            name = " · ".join(part for part in (run if len(histories) > 1 else "", label) if part) or None
            window = _window(len(values))
            widest = max(widest, window)
            shown = _rolling(values, window) if window > 1 else values
            if window > 1:
                ax.plot(steps, values, style, color=color, alpha=0.25, linewidth=0.8)
            ax.plot(
                steps, shown, style, color=color, linewidth=1.6, label=name, marker="o" if len(values) < 3 else None
            )
            key = panel.lines[0][1]
            if key == "reward" and reward_range is not None:
                _, std = series(history, "reward_std")
                if len(std) == len(values):
                    low = [max(m - s, reward_range[0]) for m, s in zip(values, std)]
                    high = [min(m + s, reward_range[1]) for m, s in zip(values, std)]
                    if window > 1:
                        low, high = _rolling(low, window), _rolling(high, window)
                    # The band: one standard deviation of the step's rewards either side of their mean, clipped to
                    # the reward's range (it says how spread the group's rewards are, what GRPO's advantages use).
                    band = f"{run + ' ' if len(histories) > 1 else ''}±1 std of the step's rewards"
                    ax.fill_between(steps, low, high, color=color, alpha=0.12, linewidth=0, label=band)
        for label, key, _ in panel.lines:
            eval_steps, eval_values = series(history, f"eval_{key}") if key else ([], [])
            if eval_values:
                ax.plot(eval_steps, eval_values, "D", color=color, markersize=5, label=f"{run} eval {label}".strip())
        summary = (evals or {}).get(run) or {}
        if panel.held_out and summary.get(f"{panel.held_out}_before") is not None:
            values = [summary.get(f"{panel.held_out}_{side}") for side in ("before", "after")]
            span = max(ax.dataLim.height, max(values) - min(values), 1e-9) if None not in values else 1.0
            last = max((e.get("step", 0) for e in history), default=0)
            for x, side, marker in ((0, "before", "o"), (last, "after", "s")):
                value = summary.get(f"{panel.held_out}_{side}")
                if value is None:
                    continue
                ax.plot([x], [value], marker, color=color, markersize=7, markeredgecolor="black", zorder=5)
                text = f"{value:.0%}" if panel.percent else f"{value:.1f}"
                if any(where == x and shown == text for where, shown, _ in annotated):
                    continue  # both runs start from the same checkpoint: one label is enough
                # Another run's label close by at the same step: move this one away from it (up or down).
                close = [v for where, _, v in annotated if where == x and abs(v - value) < 0.08 * span]
                shift = 0 if not close else (10 if value >= close[0] else -10)
                annotated.add((x, text, value))
                # Outside the curves: left of the "before" marker, right of the "after" one.
                ax.annotate(
                    text,
                    (x, value),
                    textcoords="offset points",
                    xytext=(-7 if side == "before" else 7, shift),
                    ha="right" if side == "before" else "left",
                    va="center",
                    fontsize=8,
                    color="black" if side == "before" and len(histories) > 1 else color,
                    fontweight="bold",
                )
                held_out_span = max(held_out_span, last)
        if panel.held_out == "recovery_rate" and summary.get("recovery_probe_before") is not None:
            # The recovery probe: every held-out problem started from a failing cell, with its standard error.
            last = max((e.get("step", 0) for e in history), default=0)
            ax.errorbar(
                [0, last],
                [summary["recovery_probe_before"], summary["recovery_probe_after"]],
                yerr=[summary["recovery_probe_stderr_before"], summary["recovery_probe_stderr_after"]],
                fmt="D",
                color=color,
                markerfacecolor="white",
                capsize=3,
                markersize=6,
                zorder=5,
                label=f"{run} probe (n={summary['recovery_probe_n']} per side)",
            )
            held_out_span = max(held_out_span, last)
    if held_out_span:  # room for the labels beside the markers
        ax.set_xlim(-0.16 * held_out_span, 1.16 * held_out_span)
    if reward_range is not None and panel.lines[0][1] == "reward":
        pad = 0.05 * (reward_range[1] - reward_range[0])
        ax.set_ylim(reward_range[0] - pad, reward_range[1] + pad)
    if panel.percent:
        from matplotlib.ticker import PercentFormatter

        ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    from matplotlib.ticker import MaxNLocator

    class _Steps(MaxNLocator):  # whole steps from 0: the room left of step 0 is for the labels, not for steps
        def tick_values(self, vmin, vmax):
            return [t for t in super().tick_values(max(vmin, 0), vmax) if t >= 0]

    ax.xaxis.set_major_locator(_Steps(integer=True))
    ax.set_title(panel.title, fontsize=10)
    ax.set_ylabel(panel.ylabel, fontsize=9)
    ax.set_xlabel("training step")
    ax.grid(alpha=0.3)
    return widest


def plot_runs(
    histories: Mapping[str, Sequence[dict]],
    output: str | Path,
    panels: Sequence[Panel] = RUN_PANELS,
    *,
    evals: Mapping[str, dict] | None = None,
    title: str | None = None,
    footer: str | None = None,
    ncols: int = 3,
    keep_flat: bool = False,
    reward_range: tuple[float, float] | None = None,
) -> Path:
    """Draws `panels` for one or more runs (one color per run) and saves a PNG.

    Args:
        histories (`dict[str, list[dict]]`): Run name -> TRL `log_history`.
        output (`str` or `Path`): PNG path (parent folders are created).
        panels (`list[Panel]`): Candidate panels; those with no logged value (or with constant values, unless
            `keep_flat`) are left out.
        evals (`dict[str, dict]`, *optional*): Run name -> quickstart summary entry (`<metric>_before/_after`).
        title (`str`, *optional*): Figure title (what was trained: task, model, seed).
        footer (`str`, *optional*): A line under the panels (the command and hardware that produced it).
        ncols (`int`): Panels per row.
        keep_flat (`bool`): Also draw panels whose values never change.
        reward_range (`tuple[float, float]`, *optional*): The reward's possible range (the std band stays in it);
            by default ReTool's +1/-1 when `boxed_accuracy` is the only reward logged, else no band.

    Raises:
        ValueError: nothing to plot.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    rewarded = any("reward" in entry for h in histories.values() for entry in h)
    chosen = [p for p in panels if _changes(p, histories) or (keep_flat and _has_values(p, histories))]
    chosen = [p for p in chosen if not (p.sft and rewarded)]
    # A stacked panel per run that logged its parts (parts of several runs cannot share one stack).
    chosen = [
        replace(p, run=run) if p.stacked else p
        for p in chosen
        for run in (histories if p.stacked else [None])
        if not p.stacked or _changes(p, {run: histories[run]})
    ]
    if not chosen:
        raise ValueError("nothing to plot: none of the panels' metrics was logged (or none changed).")
    ncols = max(1, min(ncols, len(chosen)))
    nrows = -(-len(chosen) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.3 * ncols, 3.1 * nrows + 0.6), squeeze=False)
    colors = run_colors(histories)
    reward_range = reward_range or _reward_range(histories)
    widest = 1
    for ax, panel in zip(axes.flat, chosen):
        widest = max(widest, _draw_panel(ax, panel, histories, colors, evals, reward_range))
        if ax.get_legend_handles_labels()[0] and not panel.stacked:  # a stack's legend is its own (top first)
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(chosen) :]:
        ax.set_visible(False)
    notes = [footer] if footer else []
    if widest > 1:
        notes.append(f"Lines: rolling mean over {widest} logged steps; faint: each step.")
    if any(p.held_out for p in chosen) and evals:
        notes.append("Markers: held-out accuracy etc. before (circle) and after (square) training, with their values.")
    if title:  # wrapped to the figure's width (about 12 characters per inch at this size)
        fig.suptitle(textwrap.fill(title, max(40, int(fig.get_figwidth() * 12))), fontsize=11)
    if notes:
        fig.text(0.01, 0.005, "  ".join(notes), fontsize=7.5, color="0.3", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.04 if notes else 0, 1, 1))
    return save_figure(fig, output, layout=False)


def _has_values(panel: Panel, histories) -> bool:
    return any(vs for h in histories.values() for _, _, vs in _panel_series(panel, h))


def plot_log_history(
    log_history: Sequence[dict],
    output: str | Path,
    metrics: Sequence[str] | None = None,
    title: str | None = None,
    ncols: int = 3,
) -> Path:
    """One run's panels (the ReTool ones, or one per key of `metrics`, flat ones kept) as a PNG; see [`plot_runs`]."""
    if metrics:
        panels = [Panel(key, "logged value", (_line("", key),)) for key in metrics]
        return plot_runs({"run": log_history}, output, panels, title=title, ncols=ncols, keep_flat=True)
    return plot_runs({"run": log_history}, output, title=title, ncols=ncols)


def save_figure(fig, output: str | Path, layout: bool = True) -> Path:
    """Lays out `fig` (unless done), writes it as a PNG at `output` (creating folders) and frees it."""
    import matplotlib.pyplot as plt

    if layout:
        fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output


def plot_comparison(
    histories: dict[str, list[dict]],
    output: str | Path,
    evals: dict[str, dict] | None = None,
    panels: Sequence[Panel] = ARITHMETIC_PANELS,
    title: str | None = None,
    footer: str | None = None,
) -> Path:
    """The quickstart's figure: `panels` in one row, one color per run, held-out before/after as markers."""
    return plot_runs(
        histories,
        output,
        panels,
        evals=evals,
        title=title,
        footer=footer,
        ncols=len(panels),
        keep_flat=True,
        reward_range=(-1.0, 1.0),  # the quickstart's boxed_accuracy: +1 correct, -1 wrong
    )


# What the quickstart's runs are, for the title of a figure of one of them.
RUN_MEANINGS = {"tool_rl": "GRPO with the interpreter", "text_rl": "GRPO without the interpreter"}


def _title(runs: Sequence[str], info: Mapping, folder: Path | None = None) -> str:
    named = [f"{run} ({RUN_MEANINGS[run]})" if run in RUN_MEANINGS and len(runs) == 1 else run for run in runs]
    parts = [" and ".join(named)]
    if len(runs) == 1 and info.get("command"):
        parts.append(str(info["command"]))
    if len(runs) == 1 and not info and folder is not None:  # nothing recorded: at least say which folder it is
        parts.append(f"training run in {folder.resolve()}")
    parts += [f"{k} {info[k]}" for k in ("task", "model", "dataset", "seed") if info.get(k) not in (None, "")]
    return " · ".join(parts)


def plot_run(run: str | Path, output: str | Path | None = None, metrics: Sequence[str] | None = None) -> Path:
    """Plots a run folder, or a folder of runs (a quickstart's `tool_rl/` and `text_rl/`, in one figure with its
    held-out before/after markers), to `output` (default: `RUN/training_curves.png`), titled with what the run was
    (`retool_run.json` or the quickstart's `summary.json`)."""
    run = Path(run)
    folder = run if run.is_dir() else run.parent
    states = find_runs(run)
    info = read_run_info(folder)
    if not info and len(states) == 1:  # e.g. retool_quickstart/ holding the one run retool_quickstart/tool_rl/
        info = read_run_info(next(iter(states.values())).parent)
    order = [name for name in info.get("runs", []) if name in states] + [
        n for n in states if n not in info.get("runs", [])
    ]
    histories = {name: load_log_history(states[name]) for name in order}
    evals = {name: info["evals"][name] for name in histories if name in info.get("evals", {})}
    output = folder / "training_curves.png" if output is None else output
    title = _title(list(histories), info, folder)
    if metrics:
        panels = [Panel(key, "logged value", (_line("", key),)) for key in metrics]
        return plot_runs(histories, output, panels, title=title, keep_flat=True)
    reward_range = tuple(info["reward_range"]) if info.get("reward_range") else None
    return plot_runs(histories, output, evals=evals or None, title=title, reward_range=reward_range)


def hardware() -> str:
    """This machine in a few words, for figure footers (the CPU quickstart runs on CPU)."""
    return f"CPU, {os.cpu_count()} cores"
