"""The `retool-trl` command line (also `python -m retool_trl`).

    retool-trl train --config configs/retool_qwen2.5-1.5b_lora.yaml [--key value ...]   GRPO with the interpreter
    retool-trl sft --config configs/sft_cold_start.yaml [--key value ...]       cold-start SFT, interpreter masked
    retool-trl eval --model PATH --dataset aime_2024 --num-samples 8            pass@1 / avg@k with the interpreter
    retool-trl quickstart [--task multiturn] [--output-dir DIR]                 the CPU quickstart(s)
    retool-trl plot --run DIR                                                   PNG of a run's logs

`train` and `sft` parse with TRL's `TrlParser` (a script-arguments dataclass + the trainer config + TRL's
`ModelConfig`), so every `GRPOConfig`/`SFTConfig` field, LoRA (`use_peft`, `lora_r`, ...) and `--config` YAML files
work as in TRL's own scripts; command-line values override the YAML.

Mistakes in the input (unknown keys, wrong types, missing columns, a tokenizer that cannot be used) end the command
with exit status 2 and one line on stderr naming the problem and the fix, before any model is loaded where possible.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import os
import sys
import typing
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trl.scripts.utils import ScriptArguments, TrlParser

PROG = "retool-trl"


class UserError(Exception):
    """A mistake in the user's input: reported as one line on stderr, without a traceback."""


# ----------------------------------------------------------------------------------------------- script arguments
@dataclass
class TrainScriptArguments(ScriptArguments):
    """Arguments of `retool-trl train` besides `ReToolConfig` and `ModelConfig`.

    Args:
        dataset_name (`str`): Training problems: a known dataset (`dapo_math`, `aime_2024`, `aime_2025`, `math500`,
            `gsm8k`, `synthetic`), a hub id, or a local `.jsonl`/`.json`/`.parquet`/`.csv` file.
        reward_funcs (`list[str]`): Reward functions by name or dotted import path.
        prompt_format (`str`): `conversational` (chat template) or `plain` text prompts.
    """

    dataset_train_split: str | None = field(
        default=None, metadata={"help": "Split of dataset_name to train on (default: the dataset's usual split)."}
    )
    dataset_test_split: str | None = field(
        default=None,
        metadata={"help": "Split of dataset_name to evaluate on when eval_strategy is set and eval_dataset_name is "
                  "not (default: 'test')."},
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["boxed_accuracy"],
        metadata={
            "help": "Reward functions: 'boxed_accuracy' (ReTool's +1/-1 on the final \\boxed{}, needs an 'answer' "
            "column), TRL's 'accuracy_reward', 'reasoning_accuracy_reward', 'think_format_reward', "
            "'get_soft_overlong_punishment', or a dotted import path such as 'my_module.my_reward'."
        },
    )
    prompt_format: str = field(
        default="conversational",
        metadata={"help": "Prompt format: 'conversational' (messages + chat template) or 'plain' text.",
                  "choices": ["conversational", "plain"]},
    )
    prompt_column: str | None = field(
        default=None, metadata={"help": "Column with the problem (default: the dataset's known column, or 'prompt', "
                                "'problem', 'question', ...)."}
    )
    answer_column: str | None = field(
        default=None, metadata={"help": "Column with the gold answer (default: 'answer', 'ground_truth', ...)."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training problems."})
    eval_dataset_name: str | None = field(
        default=None, metadata={"help": "Dataset evaluated during training (e.g. 'aime_2024'); same forms as "
                                "dataset_name."}
    )
    eval_dataset_config: str | None = field(default=None, metadata={"help": "Hub configuration of eval_dataset_name."})
    eval_dataset_split: str | None = field(
        default=None, metadata={"help": "Split of eval_dataset_name (default: the dataset's usual split)."}
    )
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only the first N evaluation problems."})
    pad_token: str | None = field(
        default=None, metadata={"help": "Pad token to set when the tokenizer has none (e.g. its EOS token)."}
    )


@dataclass
class SFTScriptArguments(ScriptArguments):
    """Arguments of `retool-trl sft` besides `SFTConfig` and `ModelConfig`.

    Traces are `messages` (system/user/assistant, as in the ReTool-SFT release, the last assistant message being the
    trained completion) or `prompt` + `completion` columns.
    """

    dataset_train_split: str | None = field(default=None, metadata={"help": "Split to train on (default: 'train')."})
    dataset_test_split: str | None = field(
        default=None, metadata={"help": "Split evaluated when eval_strategy is set (default: 'test')."}
    )
    code_start: str = field(default="<code>", metadata={"help": "Tag that opens a code block."})
    code_end: str = field(default="</code>", metadata={"help": "Tag that closes a code block."})
    interpreter_start: str = field(default="<interpreter>", metadata={"help": "Tag that opens interpreter output."})
    interpreter_end: str = field(default="</interpreter>", metadata={"help": "Tag that closes interpreter output."})
    system_prompt: str | None = field(
        default=None,
        metadata={"help": "System prompt added to traces without one: a shipped name ('retool', 'retool_concise'), "
                  "a literal prompt, or none (default). Use the same one as in the RL stage."},
    )
    messages_column: str | None = field(default=None, metadata={"help": "Column with the conversations."})
    prompt_column: str | None = field(default=None, metadata={"help": "Column with the prompts."})
    completion_column: str | None = field(default=None, metadata={"help": "Column with the completions."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N traces."})


@dataclass
class EvalArguments:
    """Arguments of `retool-trl eval` (sampling, tags, limits and sandbox come from `ReToolConfig`)."""

    model: str = field(metadata={"help": "Model folder or hub id (a LoRA adapter folder is merged into its base)."})
    dataset: str = field(metadata={"help": "Problems: a known dataset (aime_2024, aime_2025, math500, gsm8k, "
                                   "dapo_math, synthetic), a hub id or a local file."})
    dataset_config: str | None = field(default=None, metadata={"help": "Hub configuration of the dataset."})
    split: str | None = field(default=None, metadata={"help": "Split (default: the dataset's usual split)."})
    num_samples: int = field(default=1, metadata={"help": "Completions sampled per problem (k of avg@k)."})
    max_samples: int | None = field(default=None, metadata={"help": "Evaluate only the first N problems."})
    batch_size: int = field(default=16, metadata={"help": "Completions generated together."})
    prompt_format: str = field(
        default="conversational",
        metadata={"help": "'conversational' (chat template) or 'plain'.", "choices": ["conversational", "plain"]},
    )
    prompt_column: str | None = field(default=None, metadata={"help": "Column with the problem."})
    answer_column: str | None = field(default=None, metadata={"help": "Column with the gold answer."})
    dtype: str = field(
        default="auto", metadata={"help": "Model dtype.", "choices": ["auto", "bfloat16", "float16", "float32"]}
    )
    pad_token: str | None = field(default=None, metadata={"help": "Pad token to set when the tokenizer has none."})
    name: str | None = field(default=None, metadata={"help": "Base name of the result files (default: 'results')."})


# ----------------------------------------------------------------------------------------------- argument parsing
class _ArgParser(argparse.ArgumentParser):
    """argparse that raises `UserError` (one line) instead of printing the usage block and exiting."""

    def error(self, message):
        raise UserError(f"{message} (see `{self.prog} --help`)")


class _TrlParser(TrlParser):
    def error(self, message):
        raise UserError(f"{message} (see `{self.prog} --help`)")


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _hint_types(dataclass_types) -> dict[str, object]:
    hints = {}
    for dtype in dataclass_types:
        hints.update(typing.get_type_hints(dtype))
    return hints


def _allows(hint, kind: type) -> bool:
    """Whether a (possibly Optional/Union) type hint accepts values of `kind` (list or dict)."""
    if hint is kind or typing.get_origin(hint) is kind:
        return True
    return any(_allows(arg, kind) for arg in typing.get_args(hint) if typing.get_origin(hint) is not kind)


def _type_name(action) -> str:
    if action.choices is not None:
        return f"one of {list(action.choices)}"
    typ = action.type
    name = getattr(typ, "__name__", "")
    if name == "string_to_bool":
        return "true or false"
    if name in ("int", "float", "str"):
        return {"int": "an integer", "float": "a number", "str": "a string"}[name]
    return "a valid value"


def _coerce(action, key: str, value, hint, source: str):
    """Checks one YAML value against the argument it sets, and converts it as the command line would."""
    where = f"{key!r} in {source}"
    if value is None:
        return None
    if key == "resume_from_checkpoint" and isinstance(value, bool):
        return value  # transformers: True = the last checkpoint in output_dir
    if isinstance(value, dict):
        if _allows(hint, dict):
            return value
        raise UserError(f"{where} must be {_type_name(action)}, got a mapping {value!r}.")
    if isinstance(value, list):
        if action.nargs in ("+", "*"):
            return [_coerce_scalar(action, key, v, where) for v in value]
        if _allows(hint, list):
            return value
        raise UserError(f"{where} takes a single value ({_type_name(action)}), got a list {value!r}.")
    if action.nargs in ("+", "*"):
        return [_coerce_scalar(action, key, value, where)]
    return _coerce_scalar(action, key, value, where)


def _coerce_scalar(action, key: str, value, where: str):
    typ = action.type
    if typ is None:
        return value
    wants_bool = getattr(typ, "__name__", "") == "string_to_bool"
    if not isinstance(value, str) and isinstance(value, bool) != wants_bool:
        hint = " (YAML reads yes/no/on/off as booleans: quote the value)" if isinstance(value, bool) and typ is str \
            else ""
        raise UserError(f"{where} must be {_type_name(action)}, got {value!r}{hint}.")
    try:
        if isinstance(value, (bool, str)):
            converted = value if isinstance(value, bool) else typ(value)
        elif typ is float:
            converted = float(value)
        elif typ is int and float(value).is_integer():
            converted = int(value)
        else:  # wrappers (optional ints, choices) take the text the command line would give them
            converted = typ(str(value))
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        raise UserError(f"{where} must be {_type_name(action)}, got {value!r}.") from None
    if action.choices is not None and converted not in action.choices:
        raise UserError(f"{where} must be one of {list(action.choices)}, got {value!r}.")
    return converted


def _load_yaml(path: str) -> dict:
    import yaml

    try:
        with open(path) as handle:
            config = yaml.safe_load(handle)
    except FileNotFoundError:
        raise UserError(f"config file {path!r} does not exist.") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"config file {path!r} is not valid YAML{at}: {getattr(error, 'problem', error)}.") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise UserError(f"config file {path!r} must be a YAML mapping of `key: value` lines.")
    return config


def parse_arguments(dataclass_types: Sequence[type], argv: Sequence[str], prog: str, defaults: Mapping | None = None):
    """Parses `argv` (with an optional `--config FILE.yaml`) into instances of `dataclass_types` with TRL's parser.

    YAML keys are checked before anything else: unknown keys and values of the wrong type raise `UserError` naming the
    key. Command-line values win over the YAML file, which wins over `defaults` and the dataclass defaults.
    """
    with warnings.catch_warnings():
        # transformers warns about TRL's own `gradient_checkpointing` default on every parse: not the user's doing.
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.* is deprecated", category=FutureWarning)
        return _parse_arguments(dataclass_types, argv, prog, defaults)


def _parse_arguments(dataclass_types, argv, prog, defaults):
    parser = _TrlParser(dataclass_types, prog=prog, allow_abbrev=False)
    if defaults:
        parser.set_defaults(**defaults)
    args = list(argv)
    if "--config" in args:
        at = args.index("--config")
        if at + 1 >= len(args):
            raise UserError("--config needs a YAML file path.")
        path = args[at + 1]
        del args[at : at + 2]
        config = _load_yaml(path)
        env = config.pop("env", {}) or {}
        if not isinstance(env, dict):
            raise UserError(f"'env' in {path} must be a mapping of environment variables.")
        actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
        hints = _hint_types(dataclass_types)
        unknown = [key for key in config if key not in actions]
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(key, list(actions), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UserError(f"unknown key {key!r} in {path}: {hint}remove it or see `{prog} --help` for valid keys.")
        converted = {key: _coerce(actions[key], key, value, hints.get(key), path) for key, value in config.items()}
        for key, value in env.items():
            os.environ[str(key)] = str(value)
        parser.set_defaults_with_config(**converted)
    try:
        *outputs, remaining = parser.parse_args_into_dataclasses(args=args, return_remaining_strings=True)
    except UserError:
        raise
    except (ValueError, TypeError) as error:  # raised by the configs' __post_init__ checks
        message = _one_line(error)
        if "bf16" in message and "use_cpu" in message:
            message += " (on a machine without a GPU set `bf16: false` and `use_cpu: true`)"
        raise UserError(message) from None
    if remaining:
        options = [a for a in remaining if a.startswith("-")] or remaining
        known = [s for a in parser._actions for s in a.option_strings]
        close = difflib.get_close_matches(options[0].split("=")[0], known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UserError(f"unknown argument {options[0]!r}: {hint}see `{prog} --help`.")
    return tuple(outputs)


# ----------------------------------------------------------------------------------------------- checks
def check_tokenizer(tokenizer, source: str, tags: Mapping[str, str] | None = None, pad_token: str | None = None,
                    needs_chat_template: bool = False) -> None:
    """Checks (and where asked, fixes) a tokenizer before any model is loaded.

    Args:
        tokenizer: The tokenizer.
        source (`str`): Where it comes from, for messages.
        tags (`dict`, *optional*): `{config field: tag}`; each must encode and decode back to itself without unknown
            tokens, and survive `skip_special_tokens=True` (TRL decodes completions that way).
        pad_token (`str`, *optional*): Set as pad token if the tokenizer has none.
        needs_chat_template (`bool`): Conversational prompts need a chat template.

    Raises:
        UserError: naming the tokenizer, the offending tag or token, and the fix.
    """
    if tokenizer.pad_token is None:
        if pad_token is None:
            eos = tokenizer.eos_token
            fix = f"set `pad_token: {eos!r}` (its EOS token)" if eos else "set `pad_token` to one of its tokens"
            raise UserError(f"the tokenizer of {source} has no pad token: {fix} in the config, or pass --pad_token.")
        token_id = tokenizer.convert_tokens_to_ids(pad_token)
        if token_id is None or (tokenizer.unk_token_id is not None and token_id == tokenizer.unk_token_id
                                and pad_token != tokenizer.unk_token):
            raise UserError(f"pad_token {pad_token!r} is not a token of the tokenizer of {source}; use an existing "
                            f"token such as {tokenizer.eos_token!r}.")
        tokenizer.pad_token = pad_token
    if needs_chat_template and not getattr(tokenizer, "chat_template", None):
        raise UserError(f"the tokenizer of {source} has no chat template, which conversational prompts need: set "
                        "`prompt_format: plain`, or use a model whose tokenizer has a chat template.")
    unk = tokenizer.unk_token_id
    # Code is cut out of decoded text and run: a tokenizer that loses characters (e.g. whitespace) breaks it.
    probe = "Let me check.\nimport math\nx = 6 * 7\nprint(x)"
    back = tokenizer.decode(tokenizer(probe, add_special_tokens=False)["input_ids"], skip_special_tokens=True,
                            clean_up_tokenization_spaces=False)
    if back != probe:
        raise UserError(
            f"the tokenizer of {source} does not give back the text it encodes ({probe!r} decodes as {back!r}), so "
            "code written by the model cannot be run: use a tokenizer that round-trips text (check its "
            "tokenizer_class in tokenizer_config.json)."
        )
    for name, tag in (tags or {}).items():
        ids = tokenizer(tag, add_special_tokens=False)["input_ids"]
        text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if (unk is not None and unk in ids) or text != tag:
            how = "contains unknown tokens" if unk is not None and unk in ids else f"decodes back as {text!r}"
            raise UserError(
                f"{name} {tag!r} cannot be represented by the tokenizer of {source} (it {how}): choose a tag made of "
                f"text the tokenizer knows, or add it with `tokenizer.add_tokens([{tag!r}])` and resize the model's "
                "embeddings."
            )
        if tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) != tag:
            raise UserError(
                f"{name} {tag!r} is a special token of the tokenizer of {source}, so it is dropped when completions "
                "are decoded: add it as a regular token (`tokenizer.add_tokens([...], special_tokens=False)`) or "
                "choose another tag."
            )


_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str, revision: str | None = None, trust_remote_code: bool = False):
    """The tokenizer of a model folder or hub id, left-padded and left-truncated as TRL's GRPOTrainer loads it.

    A folder whose `tokenizer_config.json` declares a generic tokenizer (`TokenizersBackend`) is loaded as saved:
    transformers 5's `AutoTokenizer` would otherwise substitute the model type's class (e.g. `Qwen2Tokenizer` for a
    Qwen2 config), whose own pre-tokenizer can change how text is split, e.g. drop the whitespace of a character-level
    tokenizer such as the quickstart model's.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    kwargs = dict(revision=revision, trust_remote_code=trust_remote_code, padding_side="left",
                  truncation_side="left")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        config_file = Path(path, "tokenizer_config.json")
        if config_file.is_file() and type(tokenizer).__name__ not in _GENERIC_TOKENIZER_CLASSES:
            import json

            declared = json.loads(config_file.read_text()).get("tokenizer_class")
            if declared in _GENERIC_TOKENIZER_CLASSES:
                tokenizer = PreTrainedTokenizerFast.from_pretrained(path, **kwargs)
        return tokenizer
    except (OSError, ValueError) as error:
        raise UserError(f"cannot load the tokenizer of {path!r}: {_one_line(error).split('. ')[0]}; check "
                        "model_name_or_path (a local folder or a hub id).") from None


def _resolve_model_path(name: str | None, option: str = "model_name_or_path") -> str:
    if not name:
        raise UserError(f"no model given: set `{option}` in the config or pass --{option}.")
    if name == "quickstart":  # the tiny model shipped with the package
        from .quickstart import model_path

        try:
            return model_path()
        except FileNotFoundError as error:
            raise UserError(_one_line(error)) from None
    looks_local = name.startswith((".", "/", "~")) or os.path.isabs(name)
    if looks_local and not os.path.exists(os.path.expanduser(name)):
        raise UserError(f"model folder {name!r} does not exist; check {option}.")
    return os.path.expanduser(name)


# ----------------------------------------------------------------------------------------------- rewards
# Reward kwargs the trainer itself provides; any other required parameter must be a dataset column.
_TRAINER_REWARD_KWARGS = {
    "prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments",
    "correct_reward", "incorrect_reward", "code_start", "code_end", "interpreter_start", "interpreter_end",
}


def reward_registry(max_completion_length: int | None = None) -> dict[str, Callable]:
    """Reward functions selectable by name: ours and TRL's (`trl.rewards`), as TRL's `trl grpo` script offers them."""
    from trl.rewards import accuracy_reward, get_soft_overlong_punishment, reasoning_accuracy_reward, \
        think_format_reward

    from .rewards import boxed_accuracy

    length = max_completion_length or 1280
    return {
        "boxed_accuracy": boxed_accuracy,
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        # DAPO's overlong shaping; the soft zone is the last quarter of the completion budget.
        "get_soft_overlong_punishment": get_soft_overlong_punishment(
            max_completion_len=length, soft_punish_cache=max(length // 4, 1)
        ),
    }


def resolve_reward_funcs(names: Sequence[str], max_completion_length: int | None = None) -> list[Callable]:
    """Reward functions from names (see `reward_registry`) or dotted import paths (`my_module.my_reward`)."""
    registry = reward_registry(max_completion_length)
    funcs = []
    for name in names:
        if name in registry:
            funcs.append(registry[name])
            continue
        if "." not in name:
            close = difflib.get_close_matches(name, list(registry), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise UserError(f"unknown reward function {name!r}: {hint}use one of {sorted(registry)} or a dotted "
                            "import path such as 'my_module.my_reward'.")
        module_name, attr = name.rsplit(".", 1)
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as TRL's script does: rewards next to the config are importable
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise UserError(f"reward function {name!r}: cannot import module {module_name!r} ({_one_line(error)}); "
                            "check the path and that the module is importable from the current directory.") from None
        func = getattr(module, attr, None)
        if not callable(func):
            raise UserError(f"reward function {name!r}: module {module_name!r} has no function {attr!r}.")
        funcs.append(func)
    return funcs


def check_reward_columns(funcs: Sequence[Callable], columns: Sequence[str], dataset_name: str) -> None:
    """Fails early when a reward function needs a dataset column the dataset lacks (e.g. TRL's `solution`)."""
    from .rollout import ROLLOUT_FIELDS

    provided = set(columns) | _TRAINER_REWARD_KWARGS | set(ROLLOUT_FIELDS)
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


# ----------------------------------------------------------------------------------------------- datasets
def _load_problems(name: str, split: str | None, config_name: str | None, script_args, system_prompt, max_samples,
                   seed: int = 0):
    from .data.adapters import DataError, load_math_dataset

    try:
        dataset = load_math_dataset(
            name, split, config_name=config_name, prompt_format=script_args.prompt_format, system_prompt=system_prompt,
            prompt_column=script_args.prompt_column, answer_column=script_args.answer_column,
            max_samples=max_samples, seed=seed,
        )
    except DataError as error:
        raise UserError(_one_line(error)) from None
    except Exception as error:  # noqa: BLE001 - datasets raises many types for a missing file, split or hub repo
        if type(error).__module__.startswith(("datasets", "huggingface_hub", "fsspec", "requests", "httpx")) or \
                isinstance(error, (OSError, ConnectionError)):
            raise UserError(f"cannot load dataset {name!r}: {_one_line(error)[:300]}") from None
        raise
    if len(dataset) == 0:
        raise UserError(f"dataset {name!r} (split {split or 'default'}) has no rows.")
    return dataset


def _model_init_kwargs(model_args, config_kwargs) -> dict:
    kwargs = dict(revision=model_args.model_revision, attn_implementation=model_args.attn_implementation,
                  dtype=model_args.dtype)
    kwargs.update(config_kwargs or {})
    return kwargs


def _resume_value(training_args):
    """`resume_from_checkpoint` as the Trainer wants it (True = latest checkpoint), checked before loading."""
    from transformers.trainer_utils import get_last_checkpoint

    value = training_args.resume_from_checkpoint
    if isinstance(value, str) and value.strip().lower() in ("true", "last", "latest", "1", "yes"):
        value = True
    if isinstance(value, str) and value.strip().lower() in ("false", "none", "0", "no", ""):
        value = None
    if value is True:
        out = training_args.output_dir
        if not (os.path.isdir(out) and get_last_checkpoint(out)):
            raise UserError(f"resume_from_checkpoint=true but {out!r} has no checkpoint-* folder; give a checkpoint "
                            "path or start without resume_from_checkpoint.")
    elif value and not os.path.isdir(value):
        raise UserError(f"resume_from_checkpoint: checkpoint folder {value!r} does not exist.")
    return value or None


# ----------------------------------------------------------------------------------------------- train
def parse_train_args(argv: Sequence[str]):
    """`(TrainScriptArguments, ReToolConfig, ModelConfig)` from command-line arguments (and `--config`)."""
    from trl import ModelConfig

    from .config import ReToolConfig

    return parse_arguments((TrainScriptArguments, ReToolConfig, ModelConfig), argv, f"{PROG} train")


def build_train(argv: Sequence[str]):
    """Everything `retool-trl train` does before `train()`: returns the `ReToolTrainer` (user errors raised first)."""
    from trl import get_peft_config, get_quantization_config

    from .parsing import Tags

    script_args, training_args, model_args = parse_train_args(argv)
    model_path = _resolve_model_path(model_args.model_name_or_path)
    if not script_args.dataset_name:
        raise UserError("no training data: set `dataset_name` (e.g. dapo_math, a hub id or a local .jsonl file).")
    if script_args.dataset_streaming:
        raise UserError("dataset_streaming is not supported by retool-trl train; set it to false.")
    reward_funcs = resolve_reward_funcs(script_args.reward_funcs, training_args.max_completion_length)
    _resume_value(training_args)  # checked now, before anything is loaded

    tokenizer = load_tokenizer(model_path, model_args.model_revision, training_args.trust_remote_code)
    tags = {name: getattr(training_args, name) for name in Tags.__dataclass_fields__}
    check_tokenizer(tokenizer, model_path, tags, script_args.pad_token,
                    needs_chat_template=script_args.prompt_format == "conversational")

    system = training_args.resolved_system_prompt
    train_dataset = _load_problems(script_args.dataset_name, script_args.dataset_train_split,
                                   script_args.dataset_config, script_args, system, script_args.max_train_samples,
                                   training_args.seed)
    eval_dataset = None
    if training_args.eval_strategy != "no":
        if script_args.eval_dataset_name:
            eval_dataset = _load_problems(script_args.eval_dataset_name, script_args.eval_dataset_split,
                                          script_args.eval_dataset_config, script_args, system,
                                          script_args.max_eval_samples, training_args.seed + 1)
        else:
            eval_dataset = _load_problems(script_args.dataset_name, script_args.dataset_test_split or "test",
                                          script_args.dataset_config, script_args, system,
                                          script_args.max_eval_samples, training_args.seed + 1)
    check_reward_columns(reward_funcs, train_dataset.column_names, repr(script_args.dataset_name))

    from .trainer import ReToolTrainer

    training_args.model_init_kwargs = _model_init_kwargs(model_args, training_args.model_init_kwargs)
    trainer = ReToolTrainer(
        model=model_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        quantization_config=get_quantization_config(model_args),
    )
    return trainer


def _finish(trainer, output_dir: str) -> None:
    trainer.save_model(output_dir)
    trainer.save_state()  # trainer_state.json (the log history) next to the model, for `retool-trl plot`
    end = getattr(trainer, "end", None)  # transformers >= 5.18: closes the trackers of report_to
    if callable(end):
        end()
    trainer.accelerator.print(f"Model saved to {output_dir}")


def cmd_train(argv: Sequence[str]) -> int:
    trainer = build_train(argv)
    trainer.train(resume_from_checkpoint=_resume_value(trainer.args))
    _finish(trainer, trainer.args.output_dir)
    return 0


# ----------------------------------------------------------------------------------------------- sft
def parse_sft_args(argv: Sequence[str]):
    """`(SFTScriptArguments, SFTConfig, ModelConfig)` from command-line arguments (and `--config`)."""
    from trl import ModelConfig, SFTConfig

    return parse_arguments((SFTScriptArguments, SFTConfig, ModelConfig), argv, f"{PROG} sft")


def _load_traces(name: str, split: str | None, config_name: str | None, script_args, max_samples):
    from .data.adapters import DataError, _load_local, is_local_dataset

    try:
        if is_local_dataset(name):
            dataset = _load_local(name)
        else:
            from datasets import load_dataset

            dataset = load_dataset(name, config_name, split=split or "train")
    except DataError as error:
        raise UserError(_one_line(error)) from None
    except Exception as error:  # noqa: BLE001 - see _load_problems
        if type(error).__module__.startswith(("datasets", "huggingface_hub", "fsspec")) or isinstance(error, OSError):
            raise UserError(f"cannot load dataset {name!r}: {_one_line(error)[:300]}") from None
        raise
    renames = {getattr(script_args, f"{c}_column"): c for c in ("messages", "prompt", "completion")
               if getattr(script_args, f"{c}_column")}
    for column in renames:
        if column not in dataset.column_names:
            raise UserError(f"dataset {name!r} has no column {column!r} (columns: {', '.join(dataset.column_names)}).")
    if renames:
        dataset = dataset.rename_columns({k: v for k, v in renames.items() if k != v})
    columns = set(dataset.column_names)
    if "messages" not in columns and not {"prompt", "completion"} <= columns:
        raise UserError(
            f"SFT traces need a 'messages' column or 'prompt' and 'completion' columns; dataset {name!r} has "
            f"{sorted(columns)}: set messages_column, or prompt_column and completion_column."
        )
    if len(dataset) == 0:
        raise UserError(f"dataset {name!r} has no traces.")
    keep = ["messages"] if "messages" in columns else ["prompt", "completion"]
    dataset = dataset.select_columns(keep)
    if max_samples is not None:
        dataset = dataset.select(range(min(max_samples, len(dataset))))
    return dataset


def _with_sft_system_prompt(dataset, system: str | None):
    if not system:
        return dataset

    def add(row):
        if "messages" in row:
            msgs = list(row["messages"])
            return {"messages": msgs if msgs and msgs[0]["role"] == "system" else
                    [{"role": "system", "content": system}, *msgs]}
        prompt = row["prompt"]
        if isinstance(prompt, str):
            return {"prompt": f"{system}\n\n{prompt}"}
        prompt = list(prompt)
        return {"prompt": prompt if prompt and prompt[0]["role"] == "system" else
                [{"role": "system", "content": system}, *prompt]}

    return dataset.map(add, desc="System prompt")


def _resolve_system_prompt(name: str | None, tags) -> str | None:
    from .config import SYSTEM_PROMPTS

    if name is None or name.strip().lower() == "none":
        return None
    template = SYSTEM_PROMPTS.get(name)
    return template.format(**vars(tags)) if template else name


def build_sft(argv: Sequence[str]):
    """Everything `retool-trl sft` does before `train()`: returns the `SFTTrainer` (user errors raised first)."""
    from trl import get_peft_config

    from .parsing import Tags
    from .sft import build_sft_trainer

    script_args, sft_args, model_args = parse_sft_args(argv)
    model_path = _resolve_model_path(model_args.model_name_or_path)
    if not script_args.dataset_name:
        raise UserError("no traces: set `dataset_name` (e.g. JoeYing/ReTool-SFT or a local .jsonl file).")
    if sft_args.completion_only_loss is False:
        raise UserError("completion_only_loss: false would train on prompt and interpreter tokens; remove it.")
    if sft_args.packing:
        raise UserError("packing: true is not supported for interpreter-masked traces; set packing: false.")
    _resume_value(sft_args)  # checked now, before anything is loaded
    tags = Tags(script_args.code_start, script_args.code_end, script_args.interpreter_start,
                script_args.interpreter_end)
    tokenizer = load_tokenizer(model_path, model_args.model_revision, False)
    train = _load_traces(script_args.dataset_name, script_args.dataset_train_split, script_args.dataset_config,
                         script_args, script_args.max_train_samples)
    conversational = "messages" in train.column_names or not isinstance(train[0]["prompt"], str)
    check_tokenizer(tokenizer, model_path, vars(tags), sft_args.pad_token, needs_chat_template=conversational)
    system = _resolve_system_prompt(script_args.system_prompt, tags)
    train = _with_sft_system_prompt(train, system)
    eval_dataset = None
    if sft_args.eval_strategy != "no":
        eval_dataset = _with_sft_system_prompt(
            _load_traces(script_args.dataset_name, script_args.dataset_test_split or "test",
                         script_args.dataset_config, script_args, None), system)
    sft_args.model_init_kwargs = _model_init_kwargs(model_args, sft_args.model_init_kwargs)
    try:
        return build_sft_trainer(model_path, tokenizer, train, sft_args, tags=tags, eval_dataset=eval_dataset,
                                 peft_config=get_peft_config(model_args))
    except ValueError as error:
        if "trace" in str(error) or "chat template" in str(error):  # raised by retool_trl.sft on malformed traces
            raise UserError(_one_line(error)) from None
        raise


def cmd_sft(argv: Sequence[str]) -> int:
    trainer = build_sft(argv)
    trainer.train(resume_from_checkpoint=_resume_value(trainer.args))
    _finish(trainer, trainer.args.output_dir)
    return 0


# ----------------------------------------------------------------------------------------------- eval
def parse_eval_args(argv: Sequence[str]):
    """`(EvalArguments, ReToolConfig)` from command-line arguments (and `--config`)."""
    import torch

    from .config import ReToolConfig

    gpu = torch.cuda.is_available()
    defaults = dict(output_dir="eval_results", report_to="none", bf16=gpu, use_cpu=not gpu)
    return parse_arguments((EvalArguments, ReToolConfig), argv, f"{PROG} eval", defaults)


def _load_eval_model(path: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype if dtype == "auto" else getattr(torch, dtype)}
    if os.path.isfile(os.path.join(path, "adapter_config.json")):  # a LoRA run's output: merge into its base model
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(path, **kwargs).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval()


def cmd_eval(argv: Sequence[str]) -> int:
    from .parsing import Tags

    eval_args, config = parse_eval_args(argv)
    if eval_args.num_samples < 1 or eval_args.batch_size < 1:
        raise UserError("num_samples and batch_size must be >= 1.")
    model_path = _resolve_model_path(eval_args.model, "model")
    tokenizer = load_tokenizer(model_path, None, config.trust_remote_code)
    tags = {name: getattr(config, name) for name in Tags.__dataclass_fields__}
    check_tokenizer(tokenizer, model_path, tags, eval_args.pad_token,
                    needs_chat_template=eval_args.prompt_format == "conversational")
    dataset = _load_problems(eval_args.dataset, eval_args.split, eval_args.dataset_config, eval_args,
                             config.resolved_system_prompt, eval_args.max_samples, config.seed)

    import torch

    from .evaluation import evaluate, write_report

    model = _load_eval_model(model_path, eval_args.dtype)
    torch.manual_seed(config.seed)
    report = evaluate(model, tokenizer, dataset, config, num_samples=eval_args.num_samples,
                      batch_size=eval_args.batch_size)
    report.meta.update(model=eval_args.model, dataset=eval_args.dataset, split=eval_args.split)
    paths = write_report(report, config.output_dir, eval_args.name or "results")
    print(report.markdown())
    print(f"Wrote {paths['json']} and {paths['markdown']}")
    return 0


# ----------------------------------------------------------------------------------------------- quickstart / plot
def cmd_quickstart(argv: Sequence[str]) -> int:
    # Imported lazily: the quickstart module is optional for the other commands.
    try:
        quickstart = importlib.import_module("retool_trl.quickstart")
    except ImportError as error:
        raise UserError(f"the quickstart is not available in this installation ({_one_line(error)}).") from None
    if callable(getattr(quickstart, "main", None)):
        return quickstart.main(list(argv)) or 0
    if callable(getattr(quickstart, "run_quickstart", None)):
        parser = _ArgParser(prog=f"{PROG} quickstart", description="Run the CPU quickstart.")
        parser.add_argument("--output-dir", default="retool_quickstart", help="Where the run is written.")
        args = parser.parse_args(list(argv))
        quickstart.run_quickstart(output_dir=args.output_dir)
        return 0
    raise UserError("the quickstart runner (retool_trl.quickstart.run_quickstart) is missing from this installation.")


def cmd_plot(argv: Sequence[str]) -> int:
    parser = _ArgParser(prog=f"{PROG} plot", description="Plot a training run's logs (trainer_state.json) as PNG.")
    parser.add_argument("--run", required=True, help="Training output_dir (or a checkpoint, or a trainer_state.json).")
    parser.add_argument("--output", default=None, help="PNG path (default: RUN/training_curves.png).")
    parser.add_argument("--metrics", nargs="+", default=None, help="Logged keys to plot (default: ReTool's usual).")
    args = parser.parse_args(list(argv))
    from .plotting import plot_run

    try:
        path = plot_run(args.run, output=args.output, metrics=args.metrics)
    except (FileNotFoundError, ValueError) as error:
        raise UserError(_one_line(error)) from None
    print(path)
    return 0


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "train": (cmd_train, "GRPO with the code interpreter in the rollout (ReToolTrainer)."),
    "sft": (cmd_sft, "Cold-start SFT on code-integrated traces; interpreter output is masked from the loss."),
    "eval": (cmd_eval, "pass@1 / avg@k, code ratio, calls per answer, mean length, with the interpreter."),
    "quickstart": (cmd_quickstart, "The CPU quickstart: tiny model, synthetic arithmetic, plots and summary.json."),
    "plot": (cmd_plot, "Plot a run's trainer_state.json log history as PNG."),
}


def _usage() -> str:
    lines = [f"usage: {PROG} <command> [options]   (`{PROG} <command> --help` for a command's options)", "",
             "commands:"]
    lines += [f"  {name:<11} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `retool-trl` and `python -m retool_trl`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from . import __version__

        print(f"{PROG} {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        print(f"{PROG}: error: unknown command {name!r}: {hint}expected one of {', '.join(COMMANDS)}.",
              file=sys.stderr)
        return 2
    try:
        return COMMANDS[name][0](rest) or 0
    except UserError as error:
        print(f"{PROG} {name}: error: {_one_line(error)}", file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0
    except KeyboardInterrupt:
        print(f"{PROG} {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
