"""Loading what the commands train and evaluate on: math problems (`prompt` + `answer`) and SFT traces.

Every way a dataset can fail to load as asked (a missing file, split or hub repository, a missing column, no rows)
raises [`~retool_trl.data.DataError`] with one message naming the dataset and the fix; other errors are bugs and
propagate unchanged.
"""

from __future__ import annotations

import logging

from ..format.prompts import add_system_prompt
from .adapters import DataError, _load_local, is_local_dataset, load_math_dataset

logger = logging.getLogger(__name__)

# Modules whose exceptions mean "this dataset cannot be loaded" (a missing file, split or hub repository).
_LOADER_MODULES = ("datasets", "huggingface_hub", "fsspec", "requests", "httpx")


def _is_loading_error(error: Exception) -> bool:
    return type(error).__module__.startswith(_LOADER_MODULES) or isinstance(error, (OSError, ConnectionError))


def _short(error: Exception) -> str:
    return " ".join(str(error).split())[:300] or type(error).__name__


def load_problems(
    name: str,
    split: str | None = None,
    config_name: str | None = None,
    *,
    prompt_format: str = "auto",
    system_prompt: str | None = None,
    prompt_column: str | None = None,
    answer_column: str | None = None,
    max_samples: int | None = None,
    seed: int = 0,
    option: str = "dataset_name",
):
    """[`~retool_trl.data.load_math_dataset`] for the commands: loading failures become `DataError`, and an empty
    result is an error.

    Args:
        name (`str`): A known dataset, a hub id or a local file (see `load_math_dataset`).
        split, config_name (`str`, *optional*): Split and hub configuration.
        prompt_format (`str`): `"conversational"`, `"plain"` or `"auto"` (follow the data).
        system_prompt (`str`, *optional*): Instructions added before each problem.
        prompt_column, answer_column (`str`, *optional*): Columns of the problem and the gold answer.
        max_samples (`int`, *optional*): Keep only the first rows.
        seed (`int`): Seed of the synthetic task.
        option (`str`): The setting that named the dataset, for messages.

    Raises:
        DataError: naming the dataset and what to fix.
    """
    try:
        dataset = load_math_dataset(
            name,
            split,
            config_name=config_name,
            prompt_format=prompt_format,
            system_prompt=system_prompt,
            prompt_column=prompt_column,
            answer_column=answer_column,
            max_samples=max_samples,
            seed=seed,
            option=option,
        )
    except DataError:
        raise
    except Exception as error:  # datasets raises many types for a missing file, split or hub repo
        if _is_loading_error(error):
            raise DataError(f"cannot load dataset {name!r}: {_short(error)}") from None
        raise
    if len(dataset) == 0:
        raise DataError(f"dataset {name!r} (split {split or 'default'}) has no rows.")
    return dataset


def is_conversational(dataset, column: str = "prompt") -> bool:
    """Whether the first row's `column` is a conversation (a list of messages) rather than plain text."""
    return len(dataset) > 0 and not isinstance(dataset[0][column], str)


def load_traces(
    name: str,
    split: str | None = None,
    config_name: str | None = None,
    *,
    messages_column: str | None = None,
    prompt_column: str | None = None,
    completion_column: str | None = None,
    max_samples: int | None = None,
    option: str = "dataset_name",
):
    """SFT traces: a `messages` column, or `prompt` + `completion` columns (renamed from the given columns).

    Raises:
        DataError: the dataset cannot be loaded, lacks the columns, or has no traces.
    """
    if not is_local_dataset(name):
        from ..models.names import check_hub_id

        check_hub_id(name, "dataset", option, error=DataError)
    try:
        if is_local_dataset(name):
            dataset = _load_local(name)
        else:
            from datasets import load_dataset

            dataset = load_dataset(name, config_name, split=split or "train")
    except DataError:
        raise
    except Exception as error:  # see load_problems
        if _is_loading_error(error):
            raise DataError(f"cannot load dataset {name!r}: {_short(error)}") from None
        raise
    given = {"messages": messages_column, "prompt": prompt_column, "completion": completion_column}
    renames = {column: role for role, column in given.items() if column}
    for column in renames:
        if column not in dataset.column_names:
            raise DataError(f"dataset {name!r} has no column {column!r} (columns: {', '.join(dataset.column_names)}).")
    if renames:
        dataset = dataset.rename_columns({k: v for k, v in renames.items() if k != v})
    columns = set(dataset.column_names)
    if "messages" not in columns and not {"prompt", "completion"} <= columns:
        raise DataError(
            f"SFT traces need a 'messages' column or 'prompt' and 'completion' columns; dataset {name!r} has "
            f"{sorted(columns)}: set messages_column, or prompt_column and completion_column."
        )
    if len(dataset) == 0:
        raise DataError(f"dataset {name!r} has no traces.")
    dataset = dataset.select_columns(["messages"] if "messages" in columns else ["prompt", "completion"])
    if max_samples is not None:
        dataset = dataset.select(range(min(max_samples, len(dataset))))
    return dataset


def with_trace_system_prompt(dataset, system_prompt: str | None):
    """SFT traces with `system_prompt` added where a trace has none (a system message, or text before a plain
    prompt)."""
    if not system_prompt:
        return dataset
    column = "messages" if "messages" in dataset.column_names else "prompt"
    return dataset.map(lambda row: {column: add_system_prompt(row[column], system_prompt)}, desc="System prompt")


__all__ = ["is_conversational", "load_problems", "load_traces", "with_trace_system_prompt"]
