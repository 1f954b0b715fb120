"""Reward functions by name (as TRL's `trl grpo` script selects them) and the early check of what they need.

A reward function receives, as keyword arguments, the dataset's columns, the per-completion facts of the rollout
([`~retool_trl.rollout.ROLLOUT_FIELDS`]) and what TRL's `GRPOTrainer` adds itself (`TRL_REWARD_KWARGS`). A required
parameter outside those would fail at the first reward computation, after the model is loaded; `check_reward_kwargs`
names it before.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence

from ..errors import UserError, one_line

# What `GRPOTrainer._calculate_rewards` hands every reward function besides the dataset columns (TRL 1.16).
TRL_REWARD_KWARGS = (
    "prompts",
    "completions",
    "completion_ids",
    "trainer_state",
    "log_extra",
    "log_metric",
    "environments",
)


def reward_registry(max_completion_length: int | None = None) -> dict[str, Callable]:
    """Reward functions selectable by name: ours and TRL's (`trl.rewards`), as TRL's `trl grpo` script offers them."""
    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    from .functions import boxed_accuracy, boxed_accuracy_and_recovery

    length = max_completion_length or 1280
    return {
        "boxed_accuracy": boxed_accuracy,
        "boxed_accuracy_and_recovery": boxed_accuracy_and_recovery,
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        # DAPO's overlong shaping; the soft zone is the last quarter of the completion budget.
        "get_soft_overlong_punishment": get_soft_overlong_punishment(
            max_completion_len=length, soft_punish_cache=max(length // 4, 1)
        ),
    }


def resolve_reward_funcs(names: Sequence[str], max_completion_length: int | None = None) -> list[Callable]:
    """Reward functions from names (see `reward_registry`) or dotted import paths (`my_module.my_reward`).

    Raises:
        UserError: an unknown name (with the closest known one), a module that cannot be imported, a missing function.
    """
    registry = reward_registry(max_completion_length)
    funcs = []
    for name in names:
        if name in registry:
            funcs.append(registry[name])
            continue
        if "." not in name:
            close = difflib.get_close_matches(name, list(registry), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UserError(
                f"unknown reward function {name!r}: {hint}use one of {sorted(registry)} or a dotted import path "
                "such as 'my_module.my_reward'."
            )
        module_name, attr = name.rsplit(".", 1)
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as TRL's script does: rewards next to the config are importable
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise UserError(
                f"reward function {name!r}: cannot import module {module_name!r} ({one_line(error)}); check the "
                "path and that the module is importable from the current directory."
            ) from None
        func = getattr(module, attr, None)
        if not callable(func):
            raise UserError(f"reward function {name!r}: module {module_name!r} has no function {attr!r}.")
        funcs.append(func)
    return funcs


def check_reward_kwargs(funcs: Sequence[Callable], columns: Sequence[str], dataset_name: str) -> None:
    """Fails early when a reward function requires a keyword nobody provides (e.g. TRL's `solution` column).

    Provided are the dataset `columns`, the rollout's per-completion facts (`ROLLOUT_FIELDS`) and TRL's own
    (`TRL_REWARD_KWARGS`).

    Raises:
        UserError: naming the function, the parameter and the dataset's columns.
    """
    from ..rollout.spec import ROLLOUT_FIELDS

    provided = set(columns) | set(TRL_REWARD_KWARGS) | set(ROLLOUT_FIELDS)
    for func in funcs:
        try:
            params = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):
            continue
        for p in params:
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in provided:
                name = getattr(func, "__name__", repr(func))
                raise UserError(
                    f"reward function {name!r} needs a dataset column {p.name!r}, but {dataset_name} has "
                    f"{sorted(columns)}: choose another reward function or provide that column."
                )


__all__ = ["TRL_REWARD_KWARGS", "check_reward_kwargs", "resolve_reward_funcs", "reward_registry"]
