"""Rewards: functions with TRL's reward signature (`functions`) and their names for configs (`registry`).

A reward reads the model's own prose (the text format lives in `retool_trl.format`) and the rollout's facts that
arrive as keyword arguments. `from retool_trl.rewards import boxed_accuracy` is the documented path.
"""

from .functions import (
    BUILTIN_REWARDS,
    bind_config,
    boxed_accuracy,
    boxed_accuracy_and_recovery,
    final_answer,
    is_correct,
    is_equivalent,
    tool_use_shaping,
)

__all__ = [
    "BUILTIN_REWARDS",
    "bind_config",
    "boxed_accuracy",
    "boxed_accuracy_and_recovery",
    "final_answer",
    "is_correct",
    "is_equivalent",
    "tool_use_shaping",
]
