"""Drawing one panel on its matplotlib axes: a line per run and series, a rolling mean over noisy steps, the reward's
spread as a band, evaluation values and held-out before/after markers with their labels; and the choices a figure
makes from the logs (whether a panel has anything to show, the reward's range, each run's color).

matplotlib is imported only when a panel is drawn, so a caller that only picks panels does not load it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .panels import Panel
from .run_logs import series
from .stage_plot import draw_stages


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


def changes(panel: Panel, histories: Mapping[str, Sequence[dict]]) -> bool:
    """Whether a panel has something to read: values that change, or too few steps to call them flat."""
    series_ = [vs for h in histories.values() for _, _, vs in _panel_series(panel, h) if vs]
    values = [v for vs in series_ for v in vs]
    if not values:
        return False
    return max(values) - min(values) > 1e-9 or max(len(vs) for vs in series_) < 3


def reward_range_of(histories: Mapping[str, Sequence[dict]]) -> tuple[float, float] | None:
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


def draw_panel(ax, panel: Panel, histories, colors, evals, reward_range) -> int:
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


def has_values(panel: Panel, histories) -> bool:
    return any(vs for h in histories.values() for _, _, vs in _panel_series(panel, h))
