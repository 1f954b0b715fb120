"""The panel of `retool-trl plot` that says where each step's time went: the stages (`retool/time/*`) stacked per
logged step, in seconds, with the step's measured wall time drawn over them as a line (the stack reaches it when
every moment of the step was attributed)."""

from __future__ import annotations

from collections.abc import Sequence

from .run_logs import series

# (stage, label) bottom to top: the model's passes first, the rollout on top, so a growing rollout is seen growing.
STAGE_LABELS = (
    ("update", "update"),
    ("logprobs", "log-prob passes"),
    ("rewards", "rewards"),
    ("other", "batch prep"),
    ("weight_sync", "weight sync"),
    ("interpreter", "interpreter"),
    ("generation", "generation"),
)
STAGE_KEYS = tuple(f"retool/time/{stage}" for stage, _ in STAGE_LABELS)


def draw_stages(ax, history: Sequence[dict]) -> bool:
    """Stacks the logged stages of one run on `ax`; returns whether there was anything to draw."""
    steps, _ = series(history, "retool/time/step")
    columns = []
    for index, ((_, label), key) in enumerate(zip(STAGE_LABELS, STAGE_KEYS)):
        at, values = series(history, key)
        if at != steps or not any(values):
            continue  # a stage never entered (no weight sync without vLLM) gets no band
        columns.append((label, values, f"C{index}"))  # a stage keeps its color in every panel
    if not steps or not columns:
        return False
    if len(steps) < 3:  # too few steps for areas: stacked bars
        bottoms = [0.0] * len(steps)
        for label, values, color in columns:
            ax.bar(steps, values, bottom=bottoms, width=0.6, label=label, color=color, alpha=0.85)
            bottoms = [b + v for b, v in zip(bottoms, values)]
    else:
        ax.stackplot(
            steps,
            *[values for _, values, _ in columns],
            labels=[label for label, _, _ in columns],
            colors=[color for _, _, color in columns],
            alpha=0.85,
        )
    _, walls = series(history, "retool/time/step")
    ax.plot(steps, walls, "k-", linewidth=1.0, label="step (measured)", marker="o" if len(steps) < 3 else None)
    ax.set_ylim(0, max(walls) * 1.6)  # room above the stack for its legend
    handles, labels = ax.get_legend_handles_labels()
    # Top of the legend is the top of the stack; the measured step first.
    order = [len(handles) - 1, *range(len(handles) - 2, -1, -1)]
    ax.legend([handles[i] for i in order], [labels[i] for i in order], fontsize=6.5, ncol=2, loc="upper left")
    return True


__all__ = ["STAGE_KEYS", "STAGE_LABELS", "draw_stages"]
