"""Which panels a figure of a run can hold: what each shows, its unit, and the logged keys behind its series.

`RUN_PANELS` are those of `retool-trl plot`, `ARITHMETIC_PANELS` the quickstart's one row. A task adds its own by
building `Panel`s; how a panel is drawn is `panel_drawing`'s business, how panels become a figure `plotting`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .run_logs import accuracy_of
from .stage_plot import STAGE_KEYS


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


def metric_panel(key: str) -> Panel:
    """A panel of one logged key as it was logged (what `retool-trl plot --metrics KEY` asks for)."""
    return Panel(key, "logged value", (_line("", key),))


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
        "failed calls and timeouts",
        "interpreter calls (%)",
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
