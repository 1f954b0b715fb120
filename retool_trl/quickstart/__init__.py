"""The CPU quickstarts: tiny shipped models, synthetic tasks, GRPO with and without the interpreter.

- `plan`: what every task shares (the run's settings [`QuickstartArguments`], the GRPO config [`rl_config`], the
  [`TaskPlan`] a task hands the runner);
- `arithmetic`: one code call per answer (the default task, `model_path()`);
- `multiturn`: dependent cells under a per-cell budget and recovery from a failing cell (`--task multiturn`);
- `emerge`: the arithmetic task from a checkpoint that almost never calls code: RL creates the habit
  (`--task emerge`);
- `runner`: trains and evaluates a plan ([`run_quickstart`], [`train_run`]) and is `retool-trl quickstart` ([`main`]).

Imports run one way: `runner` -> the tasks -> `plan`.
"""

# Every name is loaded on first use (PEP 562), so that `retool-trl quickstart --help` and `quickstart.plan` do not
# import torch, TRL, datasets or math-verify through the task modules.
_LAZY = {
    "build_char_tokenizer": "..models.tiny",
    "build_tiny_model": "..models.tiny",
    "QUICKSTART_MODEL_DIR": ".arithmetic",
    "QuickstartTask": ".arithmetic",
    "arithmetic_plan": ".arithmetic",
    "model_path": ".arithmetic",
    "MULTITURN_DEFAULTS": ".plan",
    "EMERGE_DEFAULTS": ".plan",
    "EMERGE_MODEL_DIR": ".emerge",
    "EmergeTask": ".emerge",
    "emerge_model_path": ".emerge",
    "emerge_plan": ".emerge",
    "plot_emergence": ".emerge",
    "MULTITURN_MODEL_DIR": ".multiturn",
    "CellBudgetSandbox": ".multiturn",
    "MultiturnTask": ".multiturn",
    "boxed_accuracy_and_recovery": ".multiturn",
    "multiturn_model_path": ".multiturn",
    "multiturn_plan": ".multiturn",
    "recovery_rate": ".multiturn",
    "RUNS": ".plan",
    "TASKS": ".plan",
    "QuickstartArguments": ".plan",
    "TaskPlan": ".plan",
    "rl_config": ".plan",
    "PLANS": ".runner",
    "main": ".runner",
    "run_quickstart": ".runner",
    "train_run": ".runner",
    # The console imports transformers' trainer.
    "CompactProgressCallback": "..reporting.console",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_LAZY})


__all__ = [
    "EMERGE_DEFAULTS",
    "EMERGE_MODEL_DIR",
    "EmergeTask",
    "emerge_model_path",
    "emerge_plan",
    "plot_emergence",
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
