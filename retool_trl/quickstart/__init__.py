"""The CPU quickstarts: tiny shipped models, synthetic tasks, GRPO with and without the interpreter.

- `plan`: what every task shares (the run's settings [`QuickstartArguments`], the GRPO config [`rl_config`], the
  [`TaskPlan`] a task hands the runner);
- `arithmetic`: one code call per answer (the default task, `model_path()`);
- `multiturn`: dependent cells under a per-cell budget and recovery from a failing cell (`--task multiturn`);
- `runner`: trains and evaluates a plan ([`run_quickstart`], [`train_run`]) and is `retool-trl quickstart` ([`main`]).

Imports run one way: `runner` -> the tasks -> `plan`.
"""

# The quickstart models are built with these (scripts/build_quickstart_model.py, scripts/build_multiturn_model.py).
from ..models.tiny import build_char_tokenizer, build_tiny_model
from .arithmetic import QUICKSTART_MODEL_DIR, QuickstartTask, arithmetic_plan, model_path
from .multiturn import (
    MULTITURN_DEFAULTS,
    MULTITURN_MODEL_DIR,
    CellBudgetSandbox,
    MultiturnTask,
    boxed_accuracy_and_recovery,
    multiturn_model_path,
    multiturn_plan,
    recovery_rate,
)
from .plan import RUNS, TASKS, QuickstartArguments, TaskPlan, rl_config
from .runner import PLANS, main, run_quickstart, train_run


def __getattr__(name):
    # Re-exported lazily: the console imports transformers' trainer, which `retool-trl quickstart --help` must not.
    if name == "CompactProgressCallback":
        from ..reporting.console import CompactProgressCallback

        return CompactProgressCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MULTITURN_DEFAULTS",
    "MULTITURN_MODEL_DIR",
    "PLANS",
    "QUICKSTART_MODEL_DIR",
    "RUNS",
    "TASKS",
    "CellBudgetSandbox",
    "CompactProgressCallback",
    "MultiturnTask",
    "QuickstartArguments",
    "QuickstartTask",
    "TaskPlan",
    "arithmetic_plan",
    "boxed_accuracy_and_recovery",
    "build_char_tokenizer",
    "build_tiny_model",
    "main",
    "model_path",
    "multiturn_model_path",
    "multiturn_plan",
    "recovery_rate",
    "rl_config",
    "run_quickstart",
    "train_run",
]
