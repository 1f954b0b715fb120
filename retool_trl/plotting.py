"""Plots of a training run's logs (`trainer_state.json` -> `log_history`) as a PNG grid, one panel per metric.

Training values are drawn as lines and evaluation values (`eval_<key>`) as markers in the same panel. Only logged
keys are drawn, so the same call works for GRPO runs (reward, accuracy, `retool/*` metrics) and SFT runs (loss,
token accuracy).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

# Default panels, in order; missing keys are skipped. `rewards/*/mean` keys are added after `reward`.
DEFAULT_METRICS = (
    "reward",
    "retool/accuracy_with_code",
    "retool/accuracy_without_code",
    "retool/code_ratio",
    "retool/calls_per_completion",
    "completions/mean_length",
    "retool/interpreter_token_fraction",
    "retool/error_rate",
    "retool/timeout_rate",
    "loss",
    "kl",
    "entropy",
    "mean_token_accuracy",
    "learning_rate",
)


def load_log_history(run: str | Path) -> list[dict]:
    """The `log_history` of a run: `run` is a `trainer_state.json`, a checkpoint folder, or an `output_dir` (its own
    `trainer_state.json`, else the one of its latest `checkpoint-*`)."""
    path = Path(run)
    if path.is_dir():
        candidates = [path / "trainer_state.json"]
        checkpoints = sorted(
            path.glob("checkpoint-*"),
            key=lambda p: int(p.name.split("-")[-1]) if p.name.split("-")[-1].isdigit() else -1,
        )
        candidates += [c / "trainer_state.json" for c in reversed(checkpoints)]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise FileNotFoundError(
                f"no trainer_state.json in {str(path)!r} or its checkpoint-* folders: point --run at the output_dir "
                "of a finished `retool-trl train`/`sft` run (or of a run with save_strategy set)."
            )
        path = found
    elif not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} does not exist.")
    try:
        return list(json.loads(path.read_text())["log_history"])
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{str(path)!r} is not a trainer_state.json with a log_history ({error}).") from None


def _series(log_history: Sequence[dict], key: str) -> tuple[list[float], list[float]]:
    steps, values = [], []
    for entry in log_history:
        value = entry.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            steps.append(entry.get("step", len(steps)))
            values.append(float(value))
    return steps, values


def available_metrics(log_history: Sequence[dict], metrics: Sequence[str] | None = None) -> list[str]:
    """The metrics that would be plotted: `metrics` (or the defaults plus every `rewards/*/mean`) that were logged,
    as training values or as `eval_` values."""
    logged = {key for entry in log_history for key in entry}
    if metrics is None:
        reward_means = sorted(k for k in logged if k.startswith("rewards/") and k.endswith("/mean"))
        metrics = [DEFAULT_METRICS[0], *reward_means, *DEFAULT_METRICS[1:]]
    return [m for m in metrics if m in logged or f"eval_{m}" in logged]


def plot_log_history(
    log_history: Sequence[dict],
    output: str | Path,
    metrics: Sequence[str] | None = None,
    title: str | None = None,
    ncols: int = 3,
) -> Path:
    """Draws one panel per logged metric and saves a PNG.

    Args:
        log_history (`list[dict]`): `TrainerState.log_history` (e.g. `trainer.state.log_history`).
        output (`str` or `Path`): PNG path (parent folders are created).
        metrics (`list[str]`, *optional*): Keys to plot; default: `DEFAULT_METRICS` plus every `rewards/*/mean`.
        title (`str`, *optional*): Figure title.
        ncols (`int`): Panels per row.

    Returns:
        The PNG path.

    Raises:
        ValueError: none of the metrics was logged.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    keys = available_metrics(log_history, metrics)
    if not keys:
        wanted = list(metrics) if metrics else "the default metrics"
        raise ValueError(f"nothing to plot: the log history has none of {wanted}; pass --metrics with logged keys.")
    ncols = max(1, min(ncols, len(keys)))
    nrows = -(-len(keys) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.0 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        steps, values = _series(log_history, key)
        if values:
            ax.plot(steps, values, label="train", linewidth=1.5, marker="o" if len(values) < 3 else None)
            if key == "reward":  # TRL logs the spread of rewards alongside their mean
                _, std = _series(log_history, "reward_std")
                if len(std) == len(values):
                    ax.fill_between(
                        steps, [v - s for v, s in zip(values, std)], [v + s for v, s in zip(values, std)], alpha=0.2
                    )
        eval_steps, eval_values = _series(log_history, f"eval_{key}")
        if eval_values:
            ax.plot(eval_steps, eval_values, "o--", label="eval", markersize=4)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if values and eval_values:
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(keys) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    return save_figure(fig, output)


def save_figure(fig, output: str | Path) -> Path:
    """Lays out `fig`, writes it as a PNG at `output` (creating folders) and frees it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output


# The +1/-1 reward of boxed_accuracy maps to accuracy as (r + 1) / 2.
ARITHMETIC_PANELS = (
    ("reward", "reward", lambda v: v),
    ("accuracy (train samples)", "rewards/boxed_accuracy/mean", lambda v: (v + 1) / 2),
    ("code ratio (executed calls)", "retool/code_ratio", lambda v: v),
    ("mean completion length", "completions/mean_length", lambda v: v),
)


def plot_comparison(
    histories: dict[str, list[dict]],
    output: str | Path,
    evals: dict[str, dict] | None = None,
    panels=ARITHMETIC_PANELS,
) -> Path:
    """Training metrics over GRPO steps, one panel per metric and one line per run, as a PNG.

    Args:
        histories (`dict[str, list[dict]]`): Run name -> TRL `log_history`.
        output (`str` or `Path`): PNG path.
        evals (`dict[str, dict]`, *optional*): Run name -> summary entry; held-out values before/after are drawn
            as markers on the panels of `accuracy` (accuracy panel), `calls_per_completion` and `recovery_rate`
            (with the recovery probe's `recovery_probe_before`/`_after` ± standard error where present).
        panels: `(title, logged key, transform)` per panel; the reward, accuracy, code ratio and length by default.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    def series(history, key, transform=lambda v: v):
        points = [(h["step"], transform(h[key])) for h in history if isinstance(h.get(key), (int, float))]
        return [p[0] for p in points], [p[1] for p in points]

    held_out = {
        "rewards/": "accuracy",
        "retool/calls_per_completion": "calls_per_completion",
        "retool/recovery_rate": "recovery_rate",
    }
    fig, axes = plt.subplots(1, len(panels), figsize=(4.0 * len(panels), 3.2))
    for ax, (title, key, transform) in zip(axes, panels):
        for index, (name, history) in enumerate(histories.items()):
            steps, values = series(history, key, transform)
            if values:
                ax.plot(steps, values, label=name, color=f"C{index}", linewidth=1.5)
            metric = next((m for prefix, m in held_out.items() if key.startswith(prefix)), None)
            if evals and metric and name in evals and evals[name].get(f"{metric}_before") is not None:
                last = max((h.get("step", 0) for h in history), default=0)
                ax.plot(
                    [0, last],
                    [evals[name][f"{metric}_before"], evals[name].get(f"{metric}_after")],
                    "o--",
                    color=f"C{index}",
                    alpha=0.6,
                    markersize=5,
                    label=f"{name} held-out",
                )
            probe = (evals or {}).get(name, {})
            if metric == "recovery_rate" and probe.get("recovery_probe_before") is not None:
                # The recovery probe (every held-out completion starts from a failing cell), ± its standard error.
                last = max((h.get("step", 0) for h in history), default=0)
                ax.errorbar(
                    [0, last],
                    [probe["recovery_probe_before"], probe["recovery_probe_after"]],
                    yerr=[probe["recovery_probe_stderr_before"], probe["recovery_probe_stderr_after"]],
                    fmt="s:",
                    color=f"C{index}",
                    capsize=3,
                    markersize=5,
                    label=f"{name} probe (n={probe['recovery_probe_n']})",
                )
                ax.legend(fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    return save_figure(fig, output)


def plot_run(run: str | Path, output: str | Path | None = None, metrics: Sequence[str] | None = None) -> Path:
    """Plots a run folder's logs (see [`load_log_history`]) to `output` (default: `RUN/training_curves.png`)."""
    run = Path(run)
    history = load_log_history(run)
    if output is None:
        output = (run if run.is_dir() else run.parent) / "training_curves.png"
    return plot_log_history(history, output, metrics, title=run.resolve().name)


__all__ = [
    "DEFAULT_METRICS",
    "available_metrics",
    "load_log_history",
    "plot_comparison",
    "plot_log_history",
    "plot_run",
]
