"""The figures a person reads without the README: what `retool-trl plot` and the quickstart draw, checked on the
matplotlib figure itself (titles, axis labels, which panels, where the band and the held-out markers are)."""

import json

import pytest

import retool_trl.reporting.plotting as plotting
from retool_trl.cli import main


def history(steps: int, tool: bool) -> list[dict]:
    log = []
    for s in range(1, steps + 1):
        acc = min(0.95, 0.5 + s / 60) if tool else 0.05 + 0.02 * (s % 2)
        log.append(
            {
                "step": s,
                "loss": 0.01 * (s % 3),
                "reward": 2 * acc - 1,
                "reward_std": 0.9,  # mean + std goes past +1: the band must stop at the reward's maximum
                "rewards/boxed_accuracy/mean": 2 * acc - 1,
                "retool/accuracy": acc,
                "retool/code_ratio": 0.6 + s / 100 if tool else 0.0,
                "retool/calls_per_completion": 0.7 if tool else 0.0,
                "retool/error_rate": 0.0,  # flat: no panel
                "retool/timeout_rate": 0.0,
                "completions/mean_length": 30 - s / 4,
                "kl": 0.001 * s,
            }
        )
    return log


@pytest.fixture
def quickstart_dir(tmp_path):
    """A folder as `retool-trl quickstart` leaves it: summary.json and one trainer_state.json per run."""
    for name, tool in (("tool_rl", True), ("text_rl", False)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.json").write_text(json.dumps({"log_history": history(30, tool)}))
    runs = {
        "tool_rl": {"accuracy_before": 0.6, "accuracy_after": 0.9, "code_ratio_before": 0.6, "code_ratio_after": 0.9},
        "text_rl": {"accuracy_before": 0.6, "accuracy_after": 0.1, "code_ratio_before": 0.0, "code_ratio_after": 0.0},
    }
    for entry in runs.values():
        entry.update(
            steps=30, mean_model_tokens_before=30.0, mean_model_tokens_after=22.0, calls_per_completion_before=0.7
        )
    summary = {**runs, "model": "/somewhere/quickstart_model", "settings": {"task": "arithmetic", "seed": 7}}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    return tmp_path


@pytest.fixture
def figures(monkeypatch):
    """The figures the plotting code saves, kept open for inspection."""
    saved = []
    real = plotting.save_figure

    def keep(fig, output, layout=True):
        saved.append(fig)
        fig.savefig(output, dpi=30)
        return output

    monkeypatch.setattr(plotting, "save_figure", keep)
    yield saved
    monkeypatch.setattr(plotting, "save_figure", real)


def panels(fig) -> dict:
    return {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}


def test_plot_of_a_quickstart_folder(quickstart_dir, figures, capsys):
    """`retool-trl plot --run runs/quickstart` (the folder the quickstart just wrote) plots both runs together."""
    assert main(["plot", "--run", str(quickstart_dir)]) == 0
    assert (quickstart_dir / "training_curves.png").is_file()
    fig = figures[-1]
    title = fig._suptitle.get_text()
    assert "tool_rl" in title and "text_rl" in title and "quickstart_model" in title and "seed 7" in title
    drawn = panels(fig)
    assert {"reward", "accuracy", "code ratio", "interpreter calls", "completion length"} <= set(drawn)
    assert "failed calls and timeouts" not in drawn  # always 0: nothing to read
    assert "loss" not in drawn  # a GRPO run's loss says little
    for ax in drawn.values():
        assert ax.get_ylabel(), ax.get_title()
    # The reward band stays inside ReTool's +1/-1 range.
    band_tops = [path.vertices[:, 1].max() for c in drawn["reward"].collections for path in c.get_paths()]
    assert band_tops and max(band_tops) <= 1.0 + 1e-9
    # Held-out before/after: markers with their values, no line from step 0 to the last step.
    accuracy = drawn["accuracy"]
    texts = {t.get_text() for t in accuracy.texts}
    assert {"60%", "90%", "10%"} <= texts
    joined = [line for line in accuracy.get_lines() if list(line.get_xdata()) == [0, 30]]
    assert not joined


def test_quickstart_figure_has_title_labels_and_markers(quickstart_dir, figures):
    from retool_trl.quickstart.arithmetic import ARITHMETIC_PANELS
    from retool_trl.reporting.run_logs import load_log_history

    summary = json.loads((quickstart_dir / "summary.json").read_text())
    histories = {name: load_log_history(quickstart_dir / name) for name in ("tool_rl", "text_rl")}
    plotting.plot_comparison(
        histories, quickstart_dir / "q.png", evals=summary, panels=ARITHMETIC_PANELS, title="t", footer="cmd"
    )
    fig = figures[-1]
    for ax in panels(fig).values():
        assert ax.get_ylabel() and "train samples" not in ax.get_title()
    assert any(t.get_text() == "cmd" or t.get_text().startswith("cmd") for t in fig.texts)


def test_noisy_rates_get_a_rolling_mean(figures, tmp_path):
    """A rate over a few completions per step swings by tens of points: the line drawn is a rolling mean."""
    log = [{"step": s, "reward": 0.0, "retool/recovery_rate": 1.0 if s % 2 else 0.0} for s in range(1, 41)]
    plotting.plot_log_history(log, tmp_path / "r.png")
    ax = panels(figures[-1])["recovery from a failing cell"]
    bold = max(ax.get_lines(), key=lambda line: line.get_linewidth())
    values = list(bold.get_ydata())[10:]
    assert max(values) - min(values) < 0.3  # the raw values swing by 1.0


def test_step_axes_start_at_step_zero_and_the_band_is_named(quickstart_dir, figures):
    """A reader saw a tick at step -8 (room left for the held-out labels) and a shaded band nobody explained: steps
    are ticked from 0, and the band is in the legend as the spread of the step's rewards."""
    assert main(["plot", "--run", str(quickstart_dir)]) == 0
    fig = figures[-1]
    fig.canvas.draw()
    for ax in panels(fig).values():
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and min(ticks) >= 0, (ax.get_title(), ticks)
    reward = panels(fig)["reward"]
    labels = [text.get_text() for text in reward.get_legend().get_texts()] if reward.get_legend() else []
    labels += [c.get_label() for c in reward.collections]
    assert any("std of the step's rewards" in label for label in labels), labels


def _line_colors(fig) -> dict[str, str]:
    """Each labelled line of a figure: its label -> its color, as matplotlib resolved it."""
    from matplotlib.colors import to_hex

    return {
        line.get_label(): to_hex(line.get_color())
        for ax in fig.axes
        for line in ax.get_lines()
        if not line.get_label().startswith("_")
    }


def test_a_single_run_keeps_its_color_and_says_what_it_was(quickstart_dir, figures):
    """A user plots the quickstart's folder (both runs), then `--run runs/quickstart/tool_rl` alone: the single-run
    figure drew "with code" in orange, the color of text_rl in the combined one, and its title was just `tool_rl`.
    Now no series of one run takes the other run's color, and the title says what the run was."""
    for name in ("tool_rl", "text_rl"):
        log = history(30, name == "tool_rl")
        for entry in log:  # accuracy with and without code: the panel with three series
            entry.update({"retool/accuracy_with_code": entry["retool/accuracy"], "retool/accuracy_without_code": 0.1})
            entry["retool/accuracy_without_code"] += 0.01 * (entry["step"] % 3)
        (quickstart_dir / name / "trainer_state.json").write_text(json.dumps({"log_history": log}))
    assert main(["plot", "--run", str(quickstart_dir)]) == 0
    combined = _line_colors(figures[-1])
    text_rl = {color for label, color in combined.items() if label.startswith("text_rl")}
    tool_rl = {color for label, color in combined.items() if label.startswith("tool_rl")}
    assert len(text_rl) == 1 and len(tool_rl) == 1 and text_rl != tool_rl, combined
    for run, own in (("tool_rl", tool_rl), ("text_rl", text_rl)):
        assert main(["plot", "--run", str(quickstart_dir / run)]) == 0
        fig = figures[-1]
        alone = _line_colors(fig)
        other = text_rl if run == "tool_rl" else tool_rl
        assert not other & set(alone.values()), (run, alone)
        assert own <= set(alone.values()), (run, alone)  # the run's main series keep its color
        title = fig._suptitle.get_text()
        assert "GRPO with" in title and "seed 7" in title and "quickstart_model" in title, title
