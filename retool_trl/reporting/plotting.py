"""Plots of training runs (TRL's `log_history`) as PNG: the panels a ReTool user watches, readable without a README.

This module lays out a figure and saves it: it picks, among the panels (`panels`), those with something to show (one
whose values never change is left out), draws each (`panel_drawing`: one line per run and per series, a rolling mean
over noisy steps, evaluation values as markers), and titles the figure with what the run was and how to read it. The
quickstart's held-out accuracy before and after training is drawn as two labelled markers, not as a line (two points
are not a trend).
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from .panel_drawing import changes, draw_panel, has_values, reward_range_of, run_colors
from .panels import ARITHMETIC_PANELS, RUN_PANELS, Panel, metric_panel
from .run_logs import find_runs, load_log_history, read_run_info

# Re-exported: `load_log_history` lived here first, and the panels were defined here.
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
    chosen = [p for p in panels if changes(p, histories) or (keep_flat and has_values(p, histories))]
    chosen = [p for p in chosen if not (p.sft and rewarded)]
    # A stacked panel per run that logged its parts (parts of several runs cannot share one stack).
    chosen = [
        replace(p, run=run) if p.stacked else p
        for p in chosen
        for run in (histories if p.stacked else [None])
        if not p.stacked or changes(p, {run: histories[run]})
    ]
    if not chosen:
        raise ValueError("nothing to plot: none of the panels' metrics was logged (or none changed).")
    ncols = max(1, min(ncols, len(chosen)))
    nrows = -(-len(chosen) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.3 * ncols, 3.1 * nrows + 0.6), squeeze=False)
    colors = run_colors(histories)
    reward_range = reward_range or reward_range_of(histories)
    widest = 1
    for ax, panel in zip(axes.flat, chosen):
        widest = max(widest, draw_panel(ax, panel, histories, colors, evals, reward_range))
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


def plot_log_history(
    log_history: Sequence[dict],
    output: str | Path,
    metrics: Sequence[str] | None = None,
    title: str | None = None,
    ncols: int = 3,
) -> Path:
    """One run's panels (the ReTool ones, or one per key of `metrics`, flat ones kept) as a PNG; see [`plot_runs`]."""
    if metrics:
        panels = [metric_panel(key) for key in metrics]
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
        panels = [metric_panel(key) for key in metrics]
        return plot_runs(histories, output, panels, title=title, keep_flat=True)
    reward_range = tuple(info["reward_range"]) if info.get("reward_range") else None
    return plot_runs(histories, output, evals=evals or None, title=title, reward_range=reward_range)


def hardware() -> str:
    """This machine in a few words, for figure footers (the CPU quickstart runs on CPU)."""
    return f"CPU, {os.cpu_count()} cores"
