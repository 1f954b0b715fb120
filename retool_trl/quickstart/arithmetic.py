"""The arithmetic quickstart: a tiny shipped model and a synthetic arithmetic task, one code call per answer.

The shipped checkpoint (`retool_trl/assets/quickstart_model/`) is a ~0.67M-parameter Qwen2 with a character-level
tokenizer, cold-started by SFT on synthetic traces (`scripts/build/build_quickstart_model.py` rebuilds it). It copies
an expression into `<code>print(...)</code>` well, but calls code only on part of its samples and cannot do the
arithmetic in its head, which is what the quickstart's RL runs then show.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..format.registry import get_format
from ..models.names import ASSETS, MODEL_ALIASES, quickstart_model_path
from ..reporting.panels import ARITHMETIC_PANELS
from .plan import RUNS, QuickstartArguments, TaskPlan

QUICKSTART_MODEL_DIR = ASSETS / MODEL_ALIASES["quickstart"]
# The shipped arithmetic model of each call format (`--call-format`): the same task, traces and architecture.
FORMAT_MODELS = {"tags": "quickstart", "markdown": "quickstart_markdown", "tool_call": "quickstart_tool_call"}
FORMAT_MODEL_DIRS = {name: ASSETS / MODEL_ALIASES[alias] for name, alias in FORMAT_MODELS.items()}
# The fences as single tokens of the markdown model's character-level tokenizer (in place of the four tags), so
# that a call and its answer cost about as many tokens as in `tags`.
MARKDOWN_TOKENS = ("```python\n", "```output\n", "```\n")


def model_path(call_format: str = "tags") -> str:
    """Folder of the shipped quickstart model of `call_format` (load it with `from_pretrained`)."""
    return quickstart_model_path(FORMAT_MODELS[call_format])


def format_tokenizer(call_format: str, traces=None):
    """The tokenizer a format's quickstart model is built with: the character-level one (`tags`; `markdown` with its
    fences as tokens), or for `tool_call` a small chat vocabulary trained on `traces` rendered in the format."""
    build = _TOKENIZERS.get(call_format)
    if build is None:
        raise ValueError(f"no quickstart model is built for call format {call_format!r}.")
    return build(traces)


def _char_tokenizer(traces=None):
    from ..models.tiny import build_char_tokenizer

    return build_char_tokenizer()


def _fenced_char_tokenizer(traces=None):
    from ..models.tiny import build_char_tokenizer

    return build_char_tokenizer(tags=MARKDOWN_TOKENS)


def _chat_tokenizer(traces):
    from ..format.tool_calls import TOOLS, to_tool_messages
    from ..models.tiny import build_chat_tokenizer

    template = build_chat_tokenizer(["x"], vocab_size=300)  # renders the conversations the vocabulary is trained on
    texts = (
        template.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}, *to_tool_messages(row["completion"])],
            tools=TOOLS,
            tokenize=False,
        )
        for row in traces.select(range(min(len(traces), 4000)))
    )
    return build_chat_tokenizer(texts)


_TOKENIZERS = {"tags": _char_tokenizer, "markdown": _fenced_char_tokenizer, "tool_call": _chat_tokenizer}


def record_format(folder, call_format: str) -> None:
    """Writes `folder/retool_prompt.json` for a quickstart model: its call format and how its prompts were built
    (no system prompt; conversations for `tool_call`, whose tool schema only a conversation carries)."""
    from types import SimpleNamespace

    from ..format.prompts import write_prompt_settings
    from ..format.registry import get_format

    prompt = [{"role": "user", "content": ""}] if get_format(call_format).tools else ""
    settings = SimpleNamespace(system_prompt="none", call_format=call_format)
    write_prompt_settings(folder, settings, [{"prompt": prompt}])


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


def step_curves(history: Sequence[dict]) -> dict:
    """Per GRPO step, the code ratio and accuracy of the training samples (from TRL's `log_history`)."""
    from ..reporting.run_logs import accuracy_of

    steps = [h for h in history if "retool/code_ratio" in h]
    return {
        "step_code_ratio": [h["retool/code_ratio"] for h in steps],
        "step_accuracy": [accuracy_of(h) for h in steps],
    }


def arithmetic_summarize(results: dict, histories: Mapping[str, Sequence[dict]]) -> None:
    """Adds to each run's summary its per-step curves (the seeds' plot draws them)."""
    for name in RUNS:
        results[name].update(step_curves(histories[name]))


def as_conversations(dataset):
    """The problems' prompts as one user message each: a `tool_call` model's template renders the tool schema into
    conversations only."""
    return dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})


def arithmetic_plan(args: QuickstartArguments) -> TaskPlan:
    """The arithmetic task's part of `run_quickstart`: its problems and the shipped (or given) checkpoint of the
    run's call format."""
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
    if get_format(args.call_format).tools:  # its chat template writes the tools into conversations only
        splits = {name: as_conversations(split) for name, split in splits.items()}
    return TaskPlan(
        task,
        args.model or model_path(args.call_format),
        splits,
        panels=ARITHMETIC_PANELS,
        table=arithmetic_table,
        summarize=arithmetic_summarize,
    )
