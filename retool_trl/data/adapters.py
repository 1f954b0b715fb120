r"""Adapters that turn public math datasets (and local files) into ReTool training/evaluation data.

Every adapter produces exactly two columns:

- `prompt`: the problem, either as a conversation (`[{"role": "system", ...}, {"role": "user", ...}]`, the default)
  or as plain text (`prompt_format="plain"`), with the ReTool system prompt unless `system_prompt=None`;
- `answer`: the gold final answer as a string, which [`~retool_trl.rewards.boxed_accuracy`] compares with the model's
  last `\boxed{}`.

Known datasets are looked up by short name or hub id (see `KNOWN_DATASETS`); anything else is a hub id or a local
`.jsonl` / `.json` / `.parquet` / `.csv` file (or a folder of them) with configurable column names.

Example:

```python
from retool_trl.data import load_math_dataset

train = load_math_dataset("dapo_math")                    # BytedTsinghua-SIA/DAPO-Math-17k, conversational
test = load_math_dataset("aime_2024", prompt_format="plain", system_prompt=None)
local = load_math_dataset("problems.jsonl", prompt_column="question", answer_column="final")
```
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..format.prompts import add_system_message, add_system_prompt
from ..format.registry import resolve_system_prompt

# "auto" follows the data: conversational when the problems are already conversations, plain text otherwise.
PROMPT_FORMATS = ("conversational", "plain", "auto")
LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}

# Tried in order when no column is given; covers the hub datasets below and the usual names in local files.
PROMPT_COLUMNS = ("prompt", "problem", "question", "Problem", "Question", "query", "input")
ANSWER_COLUMNS = ("answer", "Answer", "ground_truth", "final_answer", "gt", "target")


class DataError(UserError):
    """A dataset that cannot be mapped as asked (missing column, unknown format). The message names the fix."""


def _default_system_prompt() -> str:
    return resolve_system_prompt("retool")


def build_prompt(question: str, prompt_format: str = "conversational", system_prompt: str | None = None):
    """The `prompt` value of one problem.

    Args:
        question (`str`): The problem statement.
        prompt_format (`str`): `"conversational"` (a list of messages, rendered later with the chat template) or
            `"plain"` (a string: the system prompt, a blank line, then the question).
        system_prompt (`str`, *optional*): Instructions placed before the question (a system message when
            conversational).
    """
    if prompt_format == "conversational":
        return add_system_message([{"role": "user", "content": question}], system_prompt)
    if prompt_format == "plain":
        return add_system_prompt(question, system_prompt)
    raise DataError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}.")


# ------------------------------------------------------------------------------------------- per-dataset mappings
# Each takes one raw row and returns (question, answer). Row shapes are those of the hub datasets (see KNOWN_DATASETS).

# DAPO-Math-17k wraps every problem in an "Answer: $Answer" instruction (DAPO's own answer format). ReTool asks for
# \boxed{} instead, so the wrapper is removed and only the problem is kept.
_DAPO_HEAD = re.compile(r"^\s*Solve the following math problem step by step\..*?\n\n", re.DOTALL)
_DAPO_TAIL = re.compile(r"\n+\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*$")


def _message_text(prompt) -> str:
    """The user text of a prompt that may be a string or a list of messages."""
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content") or "" for m in prompt if m.get("role", "user") == "user"]
    return users[-1] if users else ""


def dapo_math_example(row: Mapping) -> tuple[str, str]:
    """`BytedTsinghua-SIA/DAPO-Math-17k` (verl layout): `prompt` is a one-message conversation whose content wraps the
    problem in DAPO's "Answer:" instructions; the gold answer is `reward_model["ground_truth"]`."""
    text = _message_text(row["prompt"])
    text = _DAPO_TAIL.sub("", _DAPO_HEAD.sub("", text, count=1))
    return text.strip(), _answer_text(row["reward_model"]["ground_truth"])


def aime_example(row: Mapping) -> tuple[str, str]:
    """AIME sets: `problem`/`answer` (HuggingFaceH4/aime_2024), `Problem`/`Answer` (Maxwell-Jia/AIME_2024) or
    `question`/`answer` (yentinglin/aime_2025, opencompass/AIME2025). Answers are integers 0-999."""
    return _pick(row, PROMPT_COLUMNS, "problem"), _answer_text(_pick(row, ANSWER_COLUMNS, "answer"))


def math500_example(row: Mapping) -> tuple[str, str]:
    """`HuggingFaceH4/MATH-500`: `problem`, and `answer` (the boxed answer of `solution`, LaTeX)."""
    return row["problem"], _answer_text(row["answer"])


def gsm8k_example(row: Mapping) -> tuple[str, str]:
    """`openai/gsm8k` (config `main`): `question`, and `answer` = worked solution ending in `#### <number>`."""
    final = str(row["answer"]).rsplit("####", 1)[-1]
    return row["question"], final.strip().replace(",", "")


def _answer_text(value) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value).strip()


def _pick(row: Mapping, candidates: Sequence[str], what: str):
    for name in candidates:
        if name in row and row[name] is not None:
            return row[name]
    raise DataError(f"no {what} column: expected one of {list(candidates)}, found {sorted(row)}.")


@dataclass(frozen=True)
class DatasetSpec:
    """A public dataset the adapters know.

    Args:
        hub_id (`str`): Hub repository.
        split (`str`): Split used when none is given.
        to_example (`Callable`): Maps one row to `(question, answer)`.
        config_name (`str`, *optional*): Hub configuration.
        columns (`tuple[str, ...]`): Columns the mapping reads (checked before mapping).
    """

    hub_id: str
    split: str
    to_example: Callable[[Mapping], tuple[str, str]]
    config_name: str | None = None
    columns: tuple[str, ...] = ()


# Column names and default splits as published on the hub. Verified against the dataset cards for DAPO-Math-17k,
# HuggingFaceH4/aime_2024, yentinglin/aime_2025 and HuggingFaceH4/MATH-500; Maxwell-Jia/AIME_2024 and openai/gsm8k
# are from their well-known layouts. `aime_example` accepts any of the usual AIME column spellings.
KNOWN_DATASETS: dict[str, DatasetSpec] = {
    "dapo_math": DatasetSpec(
        "BytedTsinghua-SIA/DAPO-Math-17k", "train", dapo_math_example, None, ("prompt", "reward_model")
    ),
    "aime_2024": DatasetSpec("HuggingFaceH4/aime_2024", "train", aime_example),
    "aime_2024_maxwell": DatasetSpec("Maxwell-Jia/AIME_2024", "train", aime_example),
    "aime_2025": DatasetSpec("yentinglin/aime_2025", "train", aime_example),
    "math500": DatasetSpec("HuggingFaceH4/MATH-500", "test", math500_example, None, ("problem", "answer")),
    "gsm8k": DatasetSpec("openai/gsm8k", "test", gsm8k_example, "main", ("question", "answer")),
}
_ALIASES = {
    "dapo": "dapo_math",
    "dapo_math_17k": "dapo_math",
    "aime24": "aime_2024",
    "aime25": "aime_2025",
    "math_500": "math500",
}


def find_known_dataset(name: str) -> DatasetSpec | None:
    """The spec of a known dataset, by short name (`dapo_math`, `aime_2024`, ...) or hub id (case-insensitive)."""
    key = name.strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key in KNOWN_DATASETS:
        return KNOWN_DATASETS[key]
    for spec in KNOWN_DATASETS.values():
        if spec.hub_id.lower() == name.strip().lower():
            return spec
    return None


# The project's own seeded tasks: arithmetic (difficulty in `config_name`), then the multi-turn quickstart's task.
SYNTHETIC_NAMES = ("synthetic", "retool_trl/synthetic", "arithmetic", "multiturn", "retool_trl/multiturn")


def check_dataset_name(name: str, option: str = "dataset_name") -> None:
    """Fails at once, before any hub call, on a name that is not a known dataset, a local file or a hub id `org/name`
    (a near miss of a known name gets "did you mean"; see [`~retool_trl.models.names.check_hub_id`])."""
    if name.strip().lower() in SYNTHETIC_NAMES or find_known_dataset(name) is not None:
        return
    from ..models.names import check_hub_id

    check_hub_id(name, "dataset", option, [*KNOWN_DATASETS, *_ALIASES, "synthetic", "multiturn"], error=DataError)


def is_local_dataset(name: str) -> bool:
    """Whether `name` refers to a local file or folder rather than a hub dataset."""
    return os.path.exists(name) or Path(name).suffix.lower() in LOCAL_FORMATS


def _load_local(path: str):
    from datasets import load_dataset

    p = Path(path)
    if not p.exists():
        raise DataError(f"dataset file {path!r} does not exist.")
    files = sorted(f for f in p.iterdir() if f.suffix.lower() in LOCAL_FORMATS) if p.is_dir() else [p]
    kinds = {LOCAL_FORMATS.get(f.suffix.lower()) for f in files}
    if not files or None in kinds or len(kinds) != 1:
        raise DataError(
            f"dataset {path!r}: expected a .jsonl, .json, .parquet or .csv file (or a folder of one kind of them)."
        )
    return load_dataset(kinds.pop(), data_files=[str(f) for f in files], split="train")


def _generic_mapping(column_names: Sequence[str], prompt_column: str | None, answer_column: str | None, source: str):
    """(question, answer) mapping for a dataset with a problem column and an answer column (or verl's layout)."""

    def choose(given, candidates, what, option):
        if given is not None:
            if given not in column_names:
                raise DataError(
                    f"dataset {source} has no column {given!r} (columns: {', '.join(column_names)}); set "
                    f"{option} to one of them."
                )
            return given
        for name in candidates:
            if name in column_names:
                return name
        return None

    prompt_col = choose(prompt_column, PROMPT_COLUMNS, "prompt", "prompt_column")
    answer_col = choose(answer_column, ANSWER_COLUMNS, "answer", "answer_column")
    if answer_col is None and "reward_model" in column_names:
        answer_col = "reward_model"  # verl's RL parquet layout: reward_model.ground_truth
    for col, option, candidates in (
        (prompt_col, "prompt_column", PROMPT_COLUMNS),
        (answer_col, "answer_column", ANSWER_COLUMNS),
    ):
        if col is None:
            raise DataError(
                f"dataset {source} has no {option.split('_')[0]} column (looked for {', '.join(candidates)}; "
                f"columns: {', '.join(column_names)}); set {option} to the right column."
            )

    def to_example(row):
        answer = row[answer_col]
        if isinstance(answer, Mapping):
            answer = answer.get("ground_truth")
        return row[prompt_col], _answer_text(answer)

    return to_example


def to_retool_dataset(
    dataset,
    to_example: Callable[[Mapping], tuple],
    prompt_format: str = "conversational",
    system_prompt: str | None = None,
    num_proc: int | None = None,
):
    """Maps every row with `to_example` to `prompt` + `answer` and drops the other columns.

    A question that is already a conversation (a list of messages, e.g. verl-style `prompt` columns) is kept as is when
    `prompt_format="conversational"` (with `system_prompt` added if it has no system message), and reduced to its last
    user message when `prompt_format="plain"`.
    """
    if prompt_format not in PROMPT_FORMATS:
        raise DataError(f"prompt_format must be one of {PROMPT_FORMATS}, got {prompt_format!r}.")

    def convert(row):
        question, answer = to_example(row)
        if isinstance(question, list):
            if prompt_format == "plain":
                prompt = build_prompt(_message_text(question), "plain", system_prompt)
            else:
                prompt = add_system_message(question, system_prompt)
        else:
            prompt = build_prompt(str(question), "plain" if prompt_format == "auto" else prompt_format, system_prompt)
        if answer is None or answer == "" or answer == "None":
            raise DataError(
                f"a row has no gold answer (problem: {str(question)[:60]!r}); remove it or fix the column."
            )
        # Temporary names: an output column named like an input column would keep the input's type (e.g. int).
        return {"_retool_prompt": prompt, "_retool_answer": answer}

    if len(dataset):
        convert(dataset[0])  # fail on the first row with a clear message, before `map` wraps the exception
    mapped = dataset.map(convert, remove_columns=dataset.column_names, num_proc=num_proc, desc="ReTool format")
    return mapped.rename_columns({"_retool_prompt": "prompt", "_retool_answer": "answer"})


_DEFAULT = object()


def load_math_dataset(
    name: str,
    split: str | None = None,
    *,
    config_name: str | None = None,
    prompt_format: str = "conversational",
    system_prompt: str | None = _DEFAULT,  # type: ignore[assignment]
    prompt_column: str | None = None,
    answer_column: str | None = None,
    max_samples: int | None = None,
    seed: int = 0,
    num_proc: int | None = None,
    option: str = "dataset_name",
):
    """Loads a math dataset and maps it to `prompt` + `answer` (see the module docstring).

    Args:
        name (`str`): A known dataset (`dapo_math`, `aime_2024`, `aime_2025`, `math500`, `gsm8k`, their hub ids,
            `synthetic` arithmetic or the `multiturn` task of the multi-turn quickstart), any other hub id, or a
            local `.jsonl`/`.json`/`.parquet`/`.csv` file or folder.
        split (`str`, *optional*): Split to load (default: the dataset's usual one; `train` for local files, whose
            files are all loaded).
        config_name (`str`, *optional*): Hub configuration. For `synthetic`, the difficulty (e.g. `"2"`); for
            `multiturn`, the share of prompts that start from a failing cell (e.g. `"0.5"`).
        prompt_format (`str`): `"conversational"`, `"plain"`, or `"auto"` (conversational when the problems are
            already conversations, plain text otherwise).
        system_prompt (`str` or `None`): Instructions before each problem. Default: the shipped ReTool prompt with
            the paper's tags; `None` for none.
        prompt_column, answer_column (`str`, *optional*): Columns holding the problem and the gold answer. When given,
            they override the known dataset's mapping.
        max_samples (`int`, *optional*): Keep only the first `max_samples` rows.
        seed (`int`): Seed of the `synthetic` problems.
        num_proc (`int`, *optional*): Processes for `Dataset.map`.
        option (`str`): The setting that named the dataset, for messages.

    Returns:
        `datasets.Dataset` with columns `prompt` and `answer`.

    Raises:
        DataError: missing columns, unknown format, unreadable local file.
        UserError: a name that cannot be a dataset (see `check_dataset_name`), before any hub call.
    """
    if system_prompt is _DEFAULT:
        system_prompt = _default_system_prompt()
    if max_samples is not None and max_samples < 1:
        raise DataError(f"max_samples must be >= 1, got {max_samples}.")

    check_dataset_name(name, option)
    if name.strip().lower() in SYNTHETIC_NAMES:
        from .synthetic import make_arithmetic_dataset
        from .synthetic_multiturn import make_multiturn_dataset

        if name.strip().lower() in SYNTHETIC_NAMES[3:]:
            # The configuration is the share of prompts that start from a failing cell (the quickstart trains on 0.5).
            failing_start = float(config_name) if config_name else 0.0
            raw = make_multiturn_dataset(
                max_samples or 512, seed=seed, split=split or "train", failing_start=failing_start
            )
        else:
            difficulty = int(config_name) if config_name else 2
            raw = make_arithmetic_dataset(max_samples or 512, seed=seed, difficulty=difficulty, split=split or "train")
        to_example, source = _generic_mapping(raw.column_names, None, None, "synthetic"), "synthetic"
    else:
        spec = None if is_local_dataset(name) else find_known_dataset(name)
        if is_local_dataset(name):
            raw, source = _load_local(name), repr(name)
        else:
            from datasets import load_dataset

            hub_id = spec.hub_id if spec else name
            raw = load_dataset(
                hub_id,
                config_name or (spec.config_name if spec else None),
                split=split or (spec.split if spec else "train"),
            )
            source = repr(hub_id)
        if spec is not None and prompt_column is None and answer_column is None:
            missing = [c for c in spec.columns if c not in raw.column_names]
            if missing:
                raise DataError(
                    f"dataset {source} lacks columns {missing} (columns: {', '.join(raw.column_names)}); set "
                    "prompt_column and answer_column."
                )
            to_example = spec.to_example
        else:
            to_example = _generic_mapping(raw.column_names, prompt_column, answer_column, source)
        if max_samples is not None:
            raw = raw.select(range(min(max_samples, len(raw))))
    return to_retool_dataset(raw, to_example, prompt_format, system_prompt, num_proc)


__all__ = [
    "ANSWER_COLUMNS",
    "DataError",
    "DatasetSpec",
    "KNOWN_DATASETS",
    "PROMPT_COLUMNS",
    "PROMPT_FORMATS",
    "aime_example",
    "build_prompt",
    "check_dataset_name",
    "dapo_math_example",
    "find_known_dataset",
    "gsm8k_example",
    "is_local_dataset",
    "load_math_dataset",
    "math500_example",
    "to_retool_dataset",
]
