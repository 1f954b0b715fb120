"""`retool-trl eval`: pass@1 / avg@k, code ratio, calls per answer and length, with the interpreter in the loop.

Evaluation reads the model, the data, the sampling settings and the interpreter settings, and nothing else: its
options are those (not the optimizer, scheduler or logging fields of a training config). The sampling and
interpreter options are `ReToolConfig`'s own fields (same names, defaults and help), so a training YAML's values
carry over and there is one definition of each.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError, one_line
from ..reporting.output_folder import check_output_dir
from .common import (
    CHAT_TEMPLATE_PATH_HELP,
    PROG,
    PROMPT_FORMAT_CHOICES,
    PROMPT_FORMAT_HELP,
    data_prompt_format,
    given_options,
    report_prompt_format,
    resolve_model_path,
    short_model_name,
    take_trained_prompt_settings,
)
from .help import help_all_argv, render_help, wants_help


@dataclass
class EvalArguments:
    """The model and the data of `retool-trl eval`."""

    model: str = field(
        metadata={
            "help": "Model folder, a run folder (its model/ is used) or hub id (a LoRA adapter folder is merged into "
            "its base)."
        }
    )
    dataset: str = field(
        metadata={
            "help": "Problems: a known dataset (aime_2024, aime_2025, math500, gsm8k, "
            "dapo_math, synthetic, multiturn), a hub id or a local file."
        }
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Hub configuration of the dataset."})
    split: str | None = field(default=None, metadata={"help": "Split (default: the dataset's usual split)."})
    num_samples: int = field(default=1, metadata={"help": "Completions sampled per problem (k of avg@k)."})
    max_samples: int | None = field(default=None, metadata={"help": "Evaluate only the first N problems."})
    batch_size: int = field(default=16, metadata={"help": "Completions generated together."})
    prompt_format: str = field(default="auto", metadata={"help": PROMPT_FORMAT_HELP, "choices": PROMPT_FORMAT_CHOICES})
    prompt_column: str | None = field(default=None, metadata={"help": "Column with the problem."})
    answer_column: str | None = field(default=None, metadata={"help": "Column with the gold answer."})
    dtype: str = field(
        default="auto", metadata={"help": "Model dtype.", "choices": ["auto", "bfloat16", "float16", "float32"]}
    )
    chat_template_path: str | None = field(default=None, metadata={"help": CHAT_TEMPLATE_PATH_HELP})
    pad_token: str | None = field(default=None, metadata={"help": "Pad token to set when the tokenizer has none."})
    name: str | None = field(default=None, metadata={"help": "Base name of the result files (default: 'results')."})


# The `ReToolConfig` fields evaluation reads (see `retool_trl.evaluation.evaluate` and `inference`).
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_completion_length",
    "generation_kwargs",
    "seed",
)
# How prompts become token ids: the same as in training (`retool_trl.data.prompt_ids.tokenize_prompts`).
PROMPT_FIELDS = ("chat_template_kwargs",)
INTERPRETER_FIELDS = (
    "call_format",
    "interpreter_errors",
    "max_cell_chars",
    "code_start",
    "code_end",
    "interpreter_start",
    "interpreter_end",
    "system_prompt",
    "max_tool_calls",
    "max_interpreter_output_chars",
    "interpreter_truncation",
    "sandbox_backend",
    "sandbox_workers",
    "sandbox_timeout_s",
    "sandbox_memory_mb",
    "sandbox_url",
    "sandbox_max_concurrency",
    "sandbox_memory_wait_s",
    # The opt-in training has, so that the sandbox's refusal as root without bubblewrap names a fix that works here.
    "sandbox_allow_root_without_isolation",
)
OUTPUT_FIELDS = ("output_dir", "trust_remote_code")
_OVERRIDES = {"output_dir": ("eval_results", "Folder of the result files (NAME.json, NAME.md, NAME_samples.jsonl).")}


@dataclass
class _HelpOnly:
    """TRL's fields that `eval` reads, with `ReToolConfig`'s defaults, for `--help` alone: reading them from
    `ReToolConfig` imports torch and transformers, seconds before any help is printed (a test keeps the two equal)."""

    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling: cumulative probability kept, in (0, 1]."})
    top_k: int = field(default=0, metadata={"help": "Keep the k most likely tokens (0: all)."})
    min_p: float | None = field(default=None, metadata={"help": "Minimum token probability, relative to the top one."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "Penalty on tokens already in the text."})
    max_completion_length: int = field(default=512, metadata={"help": "Tokens per completion, all turns together."})
    generation_kwargs: str | None = field(
        default=None, metadata={"help": "More sampling arguments (transformers' GenerationConfig or vLLM's)."}
    )
    seed: int = field(default=42, metadata={"help": "Random seed."})
    chat_template_kwargs: str | None = field(
        default=None, metadata={"help": "Arguments of the chat template (e.g. enable_thinking)."}
    )
    output_dir: str = field(default=_OVERRIDES["output_dir"][0], metadata={"help": _OVERRIDES["output_dir"][1]})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow models with custom code from the Hub."})


def eval_help() -> str:
    """The short `retool-trl eval --help`: imports neither torch nor TRL."""
    from ..options import ReToolOptions

    return render_help(
        f"{PROG} eval",
        "pass@1 / avg@k, code ratio, calls per answer and mean length, with the interpreter in the loop.\n"
        "Example: retool-trl eval --model runs/quickstart/tool_rl --dataset synthetic --num_samples 4\n"
        "(a run folder's model/ is used; after `retool-trl quickstart --output-dir runs/quickstart`)",
        [
            ("model and data", [f.name for f in dataclasses.fields(EvalArguments)]),
            ("sampling", [*SAMPLING_FIELDS, *PROMPT_FIELDS]),
            ("interpreter and sandbox", list(INTERPRETER_FIELDS)),
            ("output", list(OUTPUT_FIELDS)),
        ],
        [EvalArguments, ReToolOptions, _HelpOnly],
    )


def _settings_class():
    """`EvalSettings`: a dataclass of the `ReToolConfig` fields evaluation reads, with their defaults and help."""
    from ..config import ReToolConfig

    hints = typing.get_type_hints(ReToolConfig)
    by_name = {f.name: f for f in dataclasses.fields(ReToolConfig)}
    specs = []
    for name in (*SAMPLING_FIELDS, *PROMPT_FIELDS, *INTERPRETER_FIELDS, *OUTPUT_FIELDS):
        source = by_name[name]
        metadata = dict(source.metadata)
        if name in _OVERRIDES:
            default, metadata["help"] = _OVERRIDES[name]
            spec = field(default=default, metadata=metadata)
        elif source.default_factory is not dataclasses.MISSING:
            spec = field(default_factory=source.default_factory, metadata=metadata)
        else:
            spec = field(default=source.default, metadata=metadata)
        specs.append((name, hints[name], spec))
    settings = dataclasses.make_dataclass("EvalSettings", specs)
    settings.__module__ = __name__
    return settings


def parse_eval_args(argv: Sequence[str]):
    """`(EvalArguments, ReToolConfig)` from command-line arguments (and `--config`).

    Only the model/data options and the sampling/interpreter fields are accepted; the `ReToolConfig` returned carries
    them (everything else at its default, on the GPU when there is one).
    """
    import torch

    from ..config import ReToolConfig
    from .parser import parse_arguments  # TRL's parser: imported when parsing, not for --help

    eval_args, settings = parse_arguments((EvalArguments, _settings_class()), argv, f"{PROG} eval")
    gpu = torch.cuda.is_available()
    try:
        config = ReToolConfig(**dataclasses.asdict(settings), report_to="none", bf16=gpu, use_cpu=not gpu)
    except ValueError as error:
        raise UserError(one_line(error)) from None
    return eval_args, config


def take_format_defaults(eval_args, config, given: set[str]) -> dict:
    """The evaluation options the call format sets (`CallFormat.eval_defaults`) where neither the user nor the
    model's recorded settings did. Returns what was set (and says so on one line)."""
    from ..format.registry import format_of

    fmt = format_of(config)
    taken = {}
    for name, value in fmt.eval_defaults.items():
        target = eval_args if hasattr(eval_args, name) else config
        if name not in given and getattr(target, name) != value:
            taken[name] = value
            setattr(target, name, value)
    if taken:
        shown = ", ".join(f"{k}={v!r}" for k, v in taken.items())
        print(f"Evaluation settings of call_format={fmt.name!r}: {shown}")
    return taken


def adapter_base(path: str) -> str:
    """The base model of the LoRA adapter in `path`, as its `adapter_config.json` names it. A relative folder (written
    by a run started from another working folder) is looked for from the adapter's folder up; a base that is neither
    a folder here nor reachable on the hub fails in one line, not after the hub's retries."""
    import json

    from ..models.names import check_hub_reachable

    config_path = os.path.join(path, "adapter_config.json")
    with open(config_path) as handle:
        base = json.load(handle).get("base_model_name_or_path") or ""
    if os.path.isdir(base):
        return base
    folder = os.path.abspath(path)
    for anchor in [folder, *(parent for parent in Path(folder).parents)]:
        if not os.path.isabs(base) and os.path.isdir(os.path.join(anchor, base)):
            return os.path.join(anchor, base)
    looks_local = not base or os.path.isabs(base) or base.startswith(".") or base.count("/") > 1
    if looks_local:
        raise UserError(
            f"the LoRA adapter in {path} was trained on the base model {base!r}, which is not a folder here: set "
            f"base_model_name_or_path in {config_path} to the base model's folder."
        )
    check_hub_reachable(base, f"the base model of the LoRA adapter in {path}")
    return base


def load_eval_model(path: str, dtype: str):
    """The model to evaluate, in eval mode on the GPU when there is one; a LoRA folder is merged into its base."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype if dtype == "auto" else getattr(torch, dtype)}
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        from peft import PeftConfig, PeftModel

        # As peft's AutoPeftModelForCausalLM loads it, with the base found by `adapter_base`: the base's revision,
        # and its embeddings grown to the adapter's tokenizer when tokens were added in training.
        base_path, revision = adapter_base(path), PeftConfig.from_pretrained(path).revision
        try:
            base = AutoModelForCausalLM.from_pretrained(base_path, revision=revision, **kwargs)
        except OSError as error:
            raise UserError(
                f"the base model {base_path!r} of the LoRA adapter in {path} could not be loaded ({one_line(error)}): "
                f"set base_model_name_or_path in {os.path.join(path, 'adapter_config.json')} to its folder."
            ) from None
        if os.path.isfile(os.path.join(path, "tokenizer_config.json")):
            from transformers import AutoTokenizer

            size = len(AutoTokenizer.from_pretrained(path))
            if size > base.get_input_embeddings().weight.shape[0]:
                base.resize_token_embeddings(size)
        model = PeftModel.from_pretrained(base, path).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval()


def main(argv: Sequence[str]) -> int:
    """`retool-trl eval --model PATH --dataset NAME [--num-samples K] [--key value ...]`."""
    if wants_help(argv):
        print(eval_help().rstrip("\n"))
        return 0
    from ..data.adapters import check_dataset_name
    from ..data.loading import load_problems
    from ..format.registry import format_of
    from ..models.tokenizers import check_tokenizer, load_tokenizer

    eval_args, config = parse_eval_args(help_all_argv(argv))
    if eval_args.num_samples < 1 or eval_args.batch_size < 1:
        raise UserError("num_samples and batch_size must be >= 1.")
    check_output_dir(config.output_dir)  # before the evaluation, not after it
    model_path = resolve_model_path(eval_args.model, "model")
    given = given_options(argv)
    taken = take_trained_prompt_settings(model_path, eval_args, config, given)
    take_format_defaults(eval_args, config, given | set(taken))
    check_dataset_name(eval_args.dataset, "--dataset")  # typos fail here, before any hub call
    tokenizer = load_tokenizer(model_path, None, config.trust_remote_code, eval_args.chat_template_path)
    fmt = format_of(config)
    check_tokenizer(
        tokenizer,
        model_path,
        fmt.written_tags(config),  # the tags the model itself writes
        eval_args.pad_token,
        needs_chat_template=f"call_format={fmt.name!r}"
        if fmt.needs_chat_template
        else eval_args.prompt_format == "conversational",
    )
    fmt.from_config(config, tokenizer)  # a template the format cannot use (e.g. no tool calls): refused now
    dataset = load_problems(
        eval_args.dataset,
        eval_args.split,
        eval_args.dataset_config,
        prompt_format=data_prompt_format(eval_args.prompt_format, tokenizer),
        # The system prompt goes to conversations only (the evaluation adds it where a conversation has none); plain
        # text stays as the data have it, as in training.
        system_prompt=None,
        prompt_column=eval_args.prompt_column,
        answer_column=eval_args.answer_column,
        max_samples=eval_args.max_samples,
        seed=config.seed,
    )
    report_prompt_format(eval_args.prompt_format, dataset, tokenizer, model_path)

    import torch

    from ..evaluation.scoring import evaluate
    from ..reporting.isolation import record_isolation
    from ..sandbox.factory import sandbox_from_config

    model = load_eval_model(model_path, eval_args.dtype)
    torch.manual_seed(config.seed)
    sandbox = sandbox_from_config(config)
    try:
        if config.max_tool_calls > 0:
            record_isolation(sandbox, config.output_dir)
        report = evaluate(
            model,
            tokenizer,
            dataset,
            config,
            num_samples=eval_args.num_samples,
            batch_size=eval_args.batch_size,
            desc=f"Evaluating {short_model_name(model_path)} on {eval_args.dataset}",
            sandbox=sandbox,
        )
    finally:
        sandbox.close()
    report.meta.update(model=eval_args.model, dataset=eval_args.dataset, split=eval_args.split)
    print(report.markdown())
    save_report(report, config.output_dir, eval_args.name or "results")
    return 0


def save_report(report, output_dir: str, name: str) -> None:
    """Writes the report's files; if `output_dir` stopped taking writes during the evaluation (a full disk, a mount
    gone read-only), writes them to a new temporary folder instead, says where, and fails: a finished evaluation is
    never lost."""
    from ..evaluation.scoring import write_report
    from ..reporting.output_folder import fallback_folder

    try:
        paths = write_report(report, output_dir, name)
    except OSError as error:
        saved = fallback_folder("eval")
        paths = write_report(report, saved, name)
        raise UserError(
            f"could not write the results to {output_dir!r} ({error.strerror or error}); the finished evaluation "
            f"is in {paths['json']} and {paths['markdown']}: move them where you want them."
        ) from None
    print(f"Wrote {paths['json']} and {paths['markdown']}")
