"""The arithmetic quickstart: a tiny shipped model and a synthetic arithmetic task, one code call per answer.

The shipped checkpoint (`retool_trl/assets/quickstart_model/`) is a ~0.67M-parameter Qwen2 with a character-level
tokenizer, cold-started by SFT on synthetic traces (`scripts/build/build_quickstart_model.py` rebuilds it). It copies
an expression into `<code>print(...)</code>` well, but calls code only on part of its samples and cannot do the
arithmetic in its head, which is what the quickstart's RL runs then show.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..models.names import ASSETS, MODEL_ALIASES, quickstart_model_path
from ..reporting.panels import ARITHMETIC_PANELS
from .plan import RUNS, QuickstartArguments, TaskPlan

QUICKSTART_MODEL_DIR = ASSETS / MODEL_ALIASES["quickstart"]


def model_path() -> str:
    """Folder of the shipped quickstart model (load it with `from_pretrained`)."""
    return quickstart_model_path("quickstart")


@dataclass
class QuickstartTask:
    """The synthetic task the quickstart model is built and evaluated on.

    Args:
        difficulty (`int`): Difficulty of the RL and evaluation problems (see `retool_trl.data.synthetic`).
        sft_difficulties (`list[int]`): Levels the cold-start traces cover; every operand length that is evaluated
            must appear here, since a tiny model cannot copy lengths it never saw.
        kinds (`list[str]`): Problem kinds.
        test_fraction (`float`): Share of the problem space held out for evaluation.
        code_fraction (`float`): Share of cold-start traces that call the interpreter.
    """

    difficulty: int = field(default=2, metadata={"help": "Difficulty of RL and evaluation problems."})
    sft_difficulties: list[int] = field(
        default_factory=lambda: [2], metadata={"help": "Difficulty levels covered by the cold-start traces."}
    )
    kinds: list[str] = field(default_factory=lambda: ["product", "sum", "mod"], metadata={"help": "Problem kinds."})
    test_fraction: float = field(default=0.2, metadata={"help": "Share of problems held out for evaluation."})
    code_fraction: float = field(default=0.7, metadata={"help": "Share of cold-start traces that call code."})


def arithmetic_table(summary: dict) -> str:
    """The console table of an arithmetic quickstart summary."""
    rows = [("run", "acc before", "acc after", "code ratio before -> after", "mean length after", "train time")]
    for name in RUNS:
        r = summary[name]
        rows.append(
            (
                name,
                f"{r['accuracy_before']:.1%}",
                f"{r['accuracy_after']:.1%}",
                f"{r['code_ratio_before']:.1%} -> {r['code_ratio_after']:.1%}",
                f"{r['mean_length_after']:.1f}",
                f"{r['train_s']:.0f} s",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)


def arithmetic_plan(args: QuickstartArguments) -> TaskPlan:
    """The arithmetic task's part of `run_quickstart`: its problems and the shipped (or given) checkpoint."""
    from ..data.synthetic import make_splits

    task = QuickstartTask()
    splits = make_splits(
        args.num_train,
        args.num_eval,
        seed=args.seed,
        difficulty=task.difficulty,
        kinds=task.kinds,
        test_fraction=task.test_fraction,
    )
    return TaskPlan(task, args.model or model_path(), splits, panels=ARITHMETIC_PANELS, table=arithmetic_table)
