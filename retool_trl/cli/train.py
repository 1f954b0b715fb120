"""`retool-trl train`: GRPO with the code interpreter in the rollout (`ReToolTrainer`).

Parses a script-arguments dataclass, [`~retool_trl.ReToolConfig`] and TRL's `ModelConfig` as TRL's `trl grpo` does,
so every `GRPOConfig` field, LoRA (`use_peft`, `lora_r`, ...) and `--config` YAML files work as in TRL's scripts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from trl.scripts.utils import ScriptArguments

from ..errors import UserError, one_line
from ..reporting.output_folder import check_output_dir
from .common import (
    CHAT_TEMPLATE_PATH_HELP,
    PROG,
    PROMPT_FORMAT_CHOICES,
    PROMPT_FORMAT_HELP,
    console_field,
    data_prompt_format,
    finish,
    model_init_kwargs,
    report_prompt_format,
    resolve_model_path,
    resume_value,
    set_console,
    short_model_name,
    take_run_settings,
)
from .help import help_all_argv, more_options, render_help, wants_help
from .parser import parse_arguments

_DATASET_HELP = (
    "Training problems: a known dataset (dapo_math, aime_2024, aime_2025, math500, gsm8k, synthetic, multiturn), a "
    "hub id 'org/name', or a local .jsonl/.json/.parquet/.csv file."
)
# TRL's ScriptArguments fields that `retool-trl train` does not use or refuses; listed by --help-all only.
_HIDDEN_SCRIPT_FIELDS = ("dataset_streaming", "ignore_bias_buffers", "dataset_test_split", "eval_dataset_config")


@dataclass
class TrainScriptArguments(ScriptArguments):
    """Arguments of `retool-trl train` besides `ReToolConfig` and `ModelConfig`.

    Args:
        dataset_name (`str`): Training problems: a known dataset (`dapo_math`, `aime_2024`, `aime_2025`, `math500`,
            `gsm8k`, `synthetic`), a hub id, or a local `.jsonl`/`.json`/`.parquet`/`.csv` file.
        reward_funcs (`list[str]`): Reward functions by name or dotted import path.
        prompt_format (`str`): `auto` (default), `conversational` (chat template) or `plain` text prompts.
    """

    dataset_train_split: str | None = field(
        default=None, metadata={"help": "Split of dataset_name to train on (default: the dataset's usual split)."}
    )
    dataset_test_split: str | None = field(
        default=None,
        metadata={
            "help": "Split of dataset_name to evaluate on when eval_strategy is set and eval_dataset_name is "
            "not (default: 'test')."
        },
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["boxed_accuracy"],
        metadata={
            "help": "Reward functions: 'boxed_accuracy' (ReTool's +1/-1 on the final \\boxed{}, needs an 'answer' "
            "column), TRL's 'accuracy_reward', 'reasoning_accuracy_reward', 'think_format_reward', "
            "'get_soft_overlong_punishment', or a dotted import path such as 'my_module.my_reward'."
        },
    )
    prompt_format: str = field(default="auto", metadata={"help": PROMPT_FORMAT_HELP, "choices": PROMPT_FORMAT_CHOICES})
    prompt_column: str | None = field(
        default=None,
        metadata={
            "help": "Column with the problem (default: the dataset's known column, or 'prompt', "
            "'problem', 'question', ...)."
        },
    )
    answer_column: str | None = field(
        default=None, metadata={"help": "Column with the gold answer (default: 'answer', 'ground_truth', ...)."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N training problems."})
    eval_dataset_name: str | None = field(
        default=None,
        metadata={"help": "Dataset evaluated during training (e.g. 'aime_2024'); same forms as dataset_name."},
    )
    eval_dataset_config: str | None = field(default=None, metadata={"help": "Hub configuration of eval_dataset_name."})
    eval_dataset_split: str | None = field(
        default=None, metadata={"help": "Split of eval_dataset_name (default: the dataset's usual split)."}
    )
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only the first N evaluation problems."})
    chat_template_path: str | None = field(default=None, metadata={"help": CHAT_TEMPLATE_PATH_HELP})
    pad_token: str | None = field(
        default=None, metadata={"help": "Pad token to set when the tokenizer has none (e.g. its EOS token)."}
    )
    console: str = console_field()


MODEL_HELP = (
    "Model folder, hub id 'org/name', or a tiny model shipped with the package: 'quickstart', 'quickstart_multiturn'."
)
TRL_OPTIONS = (
    "output_dir dtype max_steps num_train_epochs learning_rate per_device_train_batch_size "
    "gradient_accumulation_steps num_generations max_completion_length temperature beta loss_type use_vllm vllm_mode "
    "use_peft lora_r bf16 use_cpu logging_steps save_strategy report_to seed"
)


def train_help() -> str:
    """The short `retool-trl train --help` (imports neither torch nor TRL's trainers)."""
    from trl import ModelConfig

    from ..options import OPTION_GROUPS, ReToolOptions

    hidden = (*_HIDDEN_SCRIPT_FIELDS, "reward_funcs", "console")
    data = [f.name for f in dataclasses.fields(TrainScriptArguments) if f.name not in hidden]
    return render_help(
        f"{PROG} train",
        "GRPO with a Python interpreter in the rollout (ReToolTrainer). Options come from --config FILE.yaml (see\n"
        "configs/) and the command line, which wins. Example: retool-trl train --config configs/quickstart.yaml",
        [
            ("model and data", ["model_name_or_path", *data]),
            ("rollout", OPTION_GROUPS["rollout"]),
            ("sandbox", OPTION_GROUPS["sandbox"]),
            ("rewards", ["reward_funcs", *OPTION_GROUPS["rewards"]]),
            ("stability (off by default, as in the paper, except drop_infra_failures)", OPTION_GROUPS["stability"]),
            ("console", ["console"]),
        ],
        [TrainScriptArguments, ReToolOptions, ModelConfig],
        overrides={
            "model_name_or_path": MODEL_HELP,
            "dataset_name": _DATASET_HELP,
            "dataset_config": "Hub configuration (synthetic: the difficulty, e.g. '2').",
        },
        epilog=more_options(f"{PROG} train", "GRPOConfig", TRL_OPTIONS),
    )


def parse_train_args(argv: Sequence[str]):
    """`(TrainScriptArguments, ReToolConfig, ModelConfig)` from command-line arguments (and `--config`)."""
    from trl import ModelConfig

    from ..config import ReToolConfig

    return parse_arguments((TrainScriptArguments, ReToolConfig, ModelConfig), argv, f"{PROG} train")


def build_train(argv: Sequence[str]):
    """Everything `retool-trl train` does before `train()`: returns the `ReToolTrainer` (user errors raised first)."""
    from trl import get_peft_config, get_quantization_config

    from ..data.adapters import check_dataset_name
    from ..data.loading import load_problems
    from ..format.registry import format_of
    from ..models.tokenizers import check_tokenizer, load_tokenizer
    from ..rewards.registry import check_reward_kwargs, resolve_reward_funcs

    script_args, training_args, model_args = parse_train_args(argv)
    check_output_dir(training_args.output_dir)  # before anything is loaded
    model_path = resolve_model_path(model_args.model_name_or_path)
    if not script_args.dataset_name:
        raise UserError("no training data: set `dataset_name` (e.g. dapo_math, a hub id or a local .jsonl file).")
    if script_args.dataset_streaming:
        raise UserError("dataset_streaming is not supported by retool-trl train; set it to false.")
    reward_funcs = resolve_reward_funcs(script_args.reward_funcs, training_args.max_completion_length)
    resume_value(training_args)  # checked now, before anything is loaded
    if take_run_settings(argv, script_args, training_args, training_args, model_path):
        try:  # the settings taken are checked as the config checks them
            training_args._validate_retool_fields()
        except ValueError as error:
            raise UserError(one_line(error)) from None
    check_dataset_name(script_args.dataset_name, "dataset_name")  # typos fail here, before any hub call
    if script_args.eval_dataset_name:
        check_dataset_name(script_args.eval_dataset_name, "eval_dataset_name")

    tokenizer = load_tokenizer(
        model_path, model_args.model_revision, training_args.trust_remote_code, script_args.chat_template_path
    )
    fmt = format_of(training_args)
    check_tokenizer(
        tokenizer,
        model_path,
        fmt.written_tags(training_args),  # the tags the model itself writes (other markers are the template's)
        script_args.pad_token,
        needs_chat_template=f"call_format={fmt.name!r}"
        if fmt.needs_chat_template
        else script_args.prompt_format == "conversational",
    )

    def problems(name, split, config_name, max_samples, seed):
        return load_problems(
            name,
            split,
            config_name,
            prompt_format=data_prompt_format(script_args.prompt_format, tokenizer),
            # The system prompt goes to conversations only: the trainer adds it where a conversation has none, and
            # plain-text prompts stay as the data have them (as documented for `system_prompt`).
            system_prompt=None,
            prompt_column=script_args.prompt_column,
            answer_column=script_args.answer_column,
            max_samples=max_samples,
            seed=seed,
        )

    train_dataset = problems(
        script_args.dataset_name,
        script_args.dataset_train_split,
        script_args.dataset_config,
        script_args.max_train_samples,
        training_args.seed,
    )
    report_prompt_format(script_args.prompt_format, train_dataset, tokenizer, model_path)
    eval_dataset = None
    if training_args.eval_strategy != "no":
        if script_args.eval_dataset_name:
            eval_dataset = problems(
                script_args.eval_dataset_name,
                script_args.eval_dataset_split,
                script_args.eval_dataset_config,
                script_args.max_eval_samples,
                training_args.seed + 1,
            )
        else:
            eval_dataset = problems(
                script_args.dataset_name,
                script_args.dataset_test_split or "test",
                script_args.dataset_config,
                script_args.max_eval_samples,
                training_args.seed + 1,
            )
    check_reward_kwargs(reward_funcs, train_dataset.column_names, repr(script_args.dataset_name))

    from ..trainer import ReToolTrainer

    training_args.model_init_kwargs = model_init_kwargs(model_args, training_args.model_init_kwargs)
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
    set_console(trainer, script_args.console)
    boxed_only = set(script_args.reward_funcs) <= {"boxed_accuracy"}
    trainer.retool_run_info = {  # what `retool-trl plot` titles the run with (see `finish`)
        "command": "retool-trl train",
        "model": short_model_name(model_path),
        "dataset": script_args.dataset_name,
        # The reward's range when it is boxed_accuracy alone (tool_use_bonus keeps wrong answers below correct ones).
        "reward_range": [training_args.incorrect_reward, training_args.correct_reward] if boxed_only else None,
    }
    return trainer


def main(argv: Sequence[str]) -> int:
    """`retool-trl train [--config FILE.yaml] [--key value ...]`."""
    if wants_help(argv):
        print(train_help().rstrip("\n"))
        return 0
    trainer = build_train(help_all_argv(argv))
    if trainer.args.max_tool_calls > 0 and trainer.is_world_process_zero():
        from ..reporting.isolation import record_isolation

        record_isolation(trainer.sandbox, trainer.args.output_dir)
    trainer.train(resume_from_checkpoint=resume_value(trainer.args))
    finish(trainer, trainer.args.output_dir, trainer.retool_run_info)
    return 0
