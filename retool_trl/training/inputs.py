"""What `ReToolTrainer` checks and completes in its inputs when it is built, so that a mistake fails then, in one
line naming the fix, rather than at the first step: the chat template conversational prompts need, the `answer`
column the built-in rewards score against, and the shaping reward `tool_use_bonus` adds."""

from __future__ import annotations

from ..errors import UserError
from ..rewards.functions import BUILTIN_REWARDS, tool_use_shaping


def check_chat_template(processing_class, datasets, model) -> None:
    """Conversational prompts need a chat template: say so when the trainer is built, not at the first step."""
    from trl.data_utils import is_conversational

    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    if getattr(tokenizer, "chat_template", None) or getattr(processing_class, "chat_template", None):
        return
    for dataset in datasets:
        if dataset is None or not hasattr(dataset, "__len__") or not hasattr(dataset, "column_names"):
            continue  # an IterableDataset (or a dict of datasets) is not read ahead
        if len(dataset) and "prompt" in dataset.column_names and is_conversational(dataset[0]):
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "the model")
            raise UserError(
                f"the dataset's prompts are conversations but the tokenizer of {name} has no chat template: load "
                "the data as plain text (`prompt_format='plain'`, e.g. `load_math_dataset(name, "
                "prompt_format='plain')`) or use a model whose tokenizer has a chat template."
            )


def check_answer_column(reward_funcs, *datasets) -> None:
    """The built-in rewards score against an `answer` column: fail now, naming it, rather than at the first step."""
    needing = [func.__name__ for func in reward_funcs if func in BUILTIN_REWARDS]
    if not needing:
        return
    for dataset in datasets:
        for split, data in dataset.items() if isinstance(dataset, dict) else [(None, dataset)]:
            columns = getattr(data, "column_names", None)
            if columns is not None and "answer" not in columns:
                where = "a dataset" if split is None else f"the eval dataset {split!r}"
                raise ValueError(
                    f"The reward {needing[0]!r} (boxed_accuracy is the default when reward_funcs=None) needs an "
                    f"`answer` column with the gold answers, but {where} has only the columns {sorted(columns)}: "
                    "rename the column that holds them to `answer`, or pass your own reward_funcs."
                )


def with_shaping(reward_funcs, args) -> list:
    """Adds `tool_use_shaping` to the reward functions when `tool_use_bonus` > 0."""
    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if args.tool_use_bonus <= 0 or tool_use_shaping in funcs:
        return funcs
    if args.reward_weights is not None:
        raise ValueError(
            "ReToolConfig.tool_use_bonus > 0 adds the reward `tool_use_shaping`, but reward_weights is set: add "
            "`retool_trl.rewards.tool_use_shaping` to reward_funcs (and its weight) yourself."
        )
    return [*funcs, tool_use_shaping]


__all__ = ["check_answer_column", "check_chat_template", "with_shaping"]
