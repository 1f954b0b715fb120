r"""The multi-turn CPU quickstart: state across cells and recovery from a failing cell.

The task (`retool_trl.data.synthetic`, "the multi-turn task") is `a*b+c*d+e*f` under a per-cell length budget that
[`CellBudgetSandbox`] enforces: a cell over `max_cell_chars` is refused with an error instead of running, and no
single cell that solves a problem fits. A solution therefore needs two dependent cells, `a=<two products>` then
`print(a+<third>)`, and the second works only because the session kept `a`.

The shipped checkpoint (`retool_trl/assets/multiturn_model/`, rebuilt by `scripts/build/build_multiturn_model.py`) is
the first quickstart's model cold-started further on traces of which half begin with a failing cell; 60% of those read
the error and correct it, the rest give up and guess. RL with the interpreter has to learn to solve in cells and to
recover; RL without it cannot.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

from ..data.synthetic import Problem
from ..data.synthetic_multiturn import FAILURES, MULTITURN_CELL_CHARS, multiturn_failing_cell
from ..models.names import ASSETS, MODEL_ALIASES, quickstart_model_path
from ..reporting.panels import Panel
from ..reporting.run_logs import accuracy_of
from ..rewards.functions import boxed_accuracy_and_recovery
from ..sandbox.cell_limits import CellLimits
from .plan import MULTITURN_DEFAULTS as MULTITURN_DEFAULTS  # re-exported: its home before plan
from .plan import TaskPlan

MULTITURN_MODEL_DIR = ASSETS / MODEL_ALIASES["quickstart_multiturn"]


def multiturn_model_path() -> str:
    """Folder of the shipped multi-turn quickstart model."""
    return quickstart_model_path("quickstart_multiturn")


@dataclass
class MultiturnTask:
    """The multi-turn task, its cold start and its rollout limits.

    Args:
        max_cell_chars (`int`): Longest cell the interpreter runs; longer cells are refused with an error.
        max_tool_calls (`int`): Cells per completion (a clean solution takes 2, a recovery 3).
        max_interpreter_output_chars (`int`): Interpreter output kept per cell.
        failure_fraction (`float`): Share of cold-start traces that begin with a failing cell.
        recover_fraction (`float`): Share of those that correct the error (the rest give up).
        test_fraction (`float`): Share of problems held out for evaluation.
        failing_start (`float`): Share of the RL training prompts that end with a failing first cell and the
            interpreter's reply, as the recovery probe starts its completions. Without them the policy soon rarely
            fails by itself, RL sees few failures, and its recovery from one drifts below the cold start's (seed 0:
            probe 58.6% -> 38.3%; with half the prompts starting from a failure, 58.6% -> 94.5%).
        architecture (`dict`): `build_tiny_model` sizes of a fresh model, for a build that does not start from the
            first quickstart's checkpoint (`scripts/build/build_multiturn_model.py --init-from none`).
    """

    max_cell_chars: int = field(default=MULTITURN_CELL_CHARS, metadata={"help": "Longest cell that runs."})
    max_tool_calls: int = field(default=4, metadata={"help": "Cells per completion."})
    max_interpreter_output_chars: int = field(default=48, metadata={"help": "Interpreter output kept per cell."})
    failure_fraction: float = field(default=0.5, metadata={"help": "Cold-start traces with a failing cell."})
    recover_fraction: float = field(default=0.6, metadata={"help": "Of those, the share that recovers."})
    test_fraction: float = field(default=0.2, metadata={"help": "Share of problems held out for evaluation."})
    failing_start: float = field(
        default=0.5, metadata={"help": "Share of RL training prompts that start from a failing cell."}
    )
    architecture: dict = field(
        default_factory=lambda: {"hidden_size": 96, "num_layers": 3, "num_heads": 4, "intermediate_size": 288},
        metadata={"help": "Tiny Qwen2 sizes of a fresh (not first-quickstart-initialised) build."},
    )


class CellBudgetSandbox(CellLimits):
    """The multi-turn task's interpreter: cells over `max_cell_chars` are refused, and a failing cell is reported by
    its exception line only, exactly as the cold-start traces show it ([`CellLimits`] with `errors="last_line"`; the
    `max_cell_chars` and `interpreter_errors="last_line"` fields of `ReToolConfig` give the same in a config).

    Args:
        sandbox: The wrapped backend.
        max_cell_chars (`int`): Longest cell that runs.
    """

    def __init__(self, sandbox, max_cell_chars: int = MULTITURN_CELL_CHARS):
        super().__init__(sandbox, max_cell_chars, errors="last_line")


def recovery_rate(records: Sequence[dict]) -> tuple[float | None, int]:
    """Of the completions with at least one failing cell, the share that still ends correct, and their number.

    Args:
        records: Scored completions with `num_tool_errors` and `correct` (as in `EvalReport.records`).

    Returns:
        `(rate, count)`; `rate` is `None` when no completion had a failing cell.
    """
    failing = [r["correct"] for r in records if r["num_tool_errors"] > 0]
    return (sum(failing) / len(failing) if failing else None), len(failing)


def multiturn_eval_metrics(report) -> dict:
    """The multi-turn task's evaluation metrics beyond accuracy, code ratio and length: calls per completion, the
    recovery rate and the number of completions with a failing cell (from an `EvalReport`)."""
    rate, failing = recovery_rate(report.records)
    return {
        "calls_per_completion": report.metrics["calls_per_answer"],
        "recovery_rate": rate,
        "failing_completions": failing,
    }


# ------------------------------------------------------------------------------------------------ the recovery probe
# After RL the policy rarely writes a failing cell, so `recovery_rate` rests on a few dozen completions. The probe
# makes one for every held-out problem: the completion starts with a failing cell and the interpreter's reply to it
# (kinds of `FAILURES` in turn), and the model must read the error and finish.


def recovery_probe_prompts(dataset, max_cell_chars: int = MULTITURN_CELL_CHARS, tags=None):
    """The held-out problems of `dataset`, each prompt followed by a failing first cell and the interpreter's reply
    ([`~retool_trl.data.synthetic_multiturn.multiturn_failing_cell`]; problem `i` gets `FAILURES[i % 4]`).

    The cell fails before assigning anything, so a fresh session (what the rollout opens for the completion) is the
    state it leaves.

    Returns:
        `Dataset` with `dataset`'s columns, `prompt` extended by the failing cell, `failure` (its kind) and
        `failing_cell` (the text appended).
    """
    failures = [FAILURES[i % len(FAILURES)] for i in range(len(dataset))]
    cells = [
        multiturn_failing_cell(
            Problem(row["kind"], row["expression"], int(row["answer"]), row["difficulty"]),
            failure,
            max_cell_chars,
            tags,
        )
        for row, failure in zip(dataset, failures)
    ]
    probe = dataset.remove_columns("prompt").add_column("prompt", [p + c for p, c in zip(dataset["prompt"], cells)])
    return probe.add_column("failure", failures).add_column("failing_cell", cells)


def recovery_probe(
    model,
    tokenizer,
    dataset,
    config,
    sandbox,
    seed: int,
    when: str,
    max_cell_chars: int = MULTITURN_CELL_CHARS,
    batch_size: int = 64,
) -> dict:
    """Recovery measured on one probe completion per held-out problem, each starting from a failing first cell.

    The completions are sampled and scored exactly as the evaluation does ([`~retool_trl.evaluation.evaluate`]: the
    same rollout and interpreter, only the model's own prose counts). The forced cell is one of the completion's
    cells, so the model gets one call fewer (`max_tool_calls - 1`) and the forced cell's tokens fewer
    (`max_completion_length`) than a completion of its own. Skipped (`{}`) for a run without the interpreter
    (`max_tool_calls == 0`): its cells never run, so nothing could be repaired. The completions are written to
    `config.output_dir/probe_WHEN{.json,.md,_samples.jsonl}`.

    Args:
        model, tokenizer, dataset, config, sandbox: As for `evaluate` (`dataset`: held-out multi-turn problems).
        seed (`int`): Sampling seed.
        when (`str`): `"before"` or `"after"` (training), the suffix of the returned figures.
        max_cell_chars (`int`): The task's cell budget (the `too_long` cell's reply depends on it).
        batch_size (`int`): Completions generated together.

    Returns:
        `recovery_probe_WHEN` (share ending correct), `recovery_probe_stderr_WHEN` (`sqrt(p(1-p)/n)`),
        `recovery_probe_by_failure_WHEN` (share per failure kind) and `recovery_probe_n` (completions).
    """
    import copy

    from transformers import set_seed

    from ..evaluation.scoring import EvalReport, compute_metrics, evaluate, write_report
    from ..format.parsing import Tags

    if config.max_tool_calls == 0 or len(dataset) == 0:
        return {}
    probe = recovery_probe_prompts(dataset, max_cell_chars, Tags.from_config(config))
    set_seed(seed)
    records = []
    for failure in FAILURES:
        indices = [i for i, f in enumerate(probe["failure"]) if f == failure]
        if not indices:
            continue
        rows = probe.select(indices)
        forced = max(len(tokenizer(cell, add_special_tokens=False)["input_ids"]) for cell in rows["failing_cell"])
        limits = copy.copy(config)
        limits.max_tool_calls = config.max_tool_calls - 1
        limits.max_completion_length = max(1, config.max_completion_length - forced)
        report = evaluate(model, tokenizer, rows, limits, batch_size=batch_size, sandbox=sandbox)
        for record in report.records:
            record.update(problem=indices[record["problem"]], failure=failure)
            records.append(record)
    records.sort(key=lambda r: r["problem"])
    write_report(EvalReport(compute_metrics(records, 1), len(probe), 1, records), config.output_dir, f"probe_{when}")
    n = len(records)
    rate = sum(r["correct"] for r in records) / n
    by_failure = {}
    for f in FAILURES:
        outcomes = [r["correct"] for r in records if r["failure"] == f]
        by_failure[f] = sum(outcomes) / len(outcomes) if outcomes else None
    return {
        f"recovery_probe_{when}": rate,
        f"recovery_probe_stderr_{when}": math.sqrt(rate * (1 - rate) / n),
        f"recovery_probe_by_failure_{when}": by_failure,
        "recovery_probe_n": n,
    }


# ----------------------------------------------------------------------------------------------- the quickstart run
# `QuickstartArguments` values of `--task multiturn` where the user sets none (a completion with a recovery is up to
# ~125 tokens; the arithmetic defaults fit one call in 64).

MULTITURN_PANELS = (
    Panel("accuracy", "correct completions (%)", (("train samples", None, accuracy_of),), True, "accuracy"),
    Panel(
        "interpreter calls",
        "calls per completion",
        (("train samples", "retool/calls_per_completion", None),),
        held_out="calls_per_completion",
    ),
    Panel(
        "recovery from a failing cell",
        "correct after a failing cell (%)",
        (("train samples", "retool/recovery_rate", None),),
        percent=True,
        held_out="recovery_rate",
    ),
    Panel("failing cells", "completions with a failing cell (%)", (("", "retool/failing_cell_ratio", None),), True),
)


def multiturn_plan(args) -> TaskPlan:
    """The multi-turn task's part of `run_quickstart`: its problems, checkpoint, cell budget, reward and metrics."""
    from ..data.synthetic_multiturn import make_multiturn_splits

    task = MultiturnTask()
    splits = make_multiturn_splits(
        args.num_train,
        args.num_eval,
        seed=args.seed,
        test_fraction=task.test_fraction,
        failing_start=task.failing_start,
    )
    return TaskPlan(
        task=task,
        model=args.model or multiturn_model_path(),
        splits=splits,
        run_kwargs={
            "reward_funcs": [boxed_accuracy_and_recovery],
            "eval_metrics": multiturn_eval_metrics,
            "probe": partial(recovery_probe, max_cell_chars=task.max_cell_chars),
            "max_tool_calls": task.max_tool_calls,
            "max_interpreter_output_chars": task.max_interpreter_output_chars,
            # The per-cell budget and the one-line errors of the cold-start traces (`CellBudgetSandbox`).
            "max_cell_chars": task.max_cell_chars,
            "interpreter_errors": "last_line",
        },
        panels=MULTITURN_PANELS,
        table=multiturn_table,
    )


def multiturn_table(summary: dict) -> str:
    """The console table of a multi-turn quickstart summary."""

    def pct(value):
        return "-" if value is None else f"{value:.1%}"

    rows = [
        (
            "run",
            "accuracy before -> after",
            "calls/completion before -> after",
            "recovery before -> after (failing completions)",
            "recovery probe before -> after (n, ± standard error)",
            "train time",
        )
    ]
    for name in ("tool_rl", "text_rl"):
        r = summary[name]
        rows.append(
            (
                name,
                f"{pct(r['accuracy_before'])} -> {pct(r['accuracy_after'])}",
                f"{r['calls_per_completion_before']:.2f} -> {r['calls_per_completion_after']:.2f}",
                (
                    f"{pct(r['recovery_rate_before'])} ({r['failing_completions_before']}) -> "
                    f"{pct(r['recovery_rate_after'])} ({r['failing_completions_after']})"
                ),
                (
                    f"{pct(r['recovery_probe_before'])} -> {pct(r['recovery_probe_after'])} "
                    f"({r['recovery_probe_n']}, ± {r['recovery_probe_stderr_before']:.1%} -> "
                    f"{r['recovery_probe_stderr_after']:.1%})"
                    if "recovery_probe_n" in r
                    else "- (no interpreter)"
                ),
                f"{r['train_s']:.0f} s",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)
