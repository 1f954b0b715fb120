"""`retool-trl sft`: cold-start SFT on code-integrated traces, with the interpreter's output masked from the loss.

Traces are `messages` (system/user/assistant, as in the ReTool-SFT release, the last assistant message being the
trained completion) or `prompt` + `completion` columns. Parsed like TRL's `trl sft`: `SFTConfig` + `ModelConfig`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from trl.scripts.utils import ScriptArguments

from ..errors import UserError, one_line
from ..format.prompts import SHIPPED_PROMPTS, Tags
from ..format.registry import FORMAT_NAMES, formats_help
from .common import (
    PROG,
    PROMPT_FORMAT_CHOICES,
    console_field,
    finish,
    logger,
    model_init_kwargs,
    resolve_model_path,
    resume_value,
    set_console,
    short_model_name,
    take_run_settings,
)
from .help import help_all_argv, more_options, render_help, wants_help
from .parser import parse_arguments


@dataclass
class SFTScriptArguments(ScriptArguments):
    """Arguments of `retool-trl sft` besides `SFTConfig` and `ModelConfig`."""

    dataset_train_split: str | None = field(default=None, metadata={"help": "Split to train on (default: 'train')."})
    dataset_test_split: str | None = field(
        default=None, metadata={"help": "Split evaluated when eval_strategy is set (default: 'test')."}
    )
    call_format: str = field(
        default="tags",
        metadata={
            "help": f"Call format to train, as in RL (the traces are rewritten in it): {formats_help()}. The tags "
            "below say how the traces mark code and output.",
            "choices": FORMAT_NAMES,
        },
    )
    code_start: str = field(default=Tags.code_start, metadata={"help": "Tag that opens a code block."})
    code_end: str = field(default=Tags.code_end, metadata={"help": "Tag that closes a code block."})
    interpreter_start: str = field(
        default=Tags.interpreter_start, metadata={"help": "Tag that opens interpreter output."}
    )
    interpreter_end: str = field(
        default=Tags.interpreter_end, metadata={"help": "Tag that closes interpreter output."}
    )
    system_prompt: str | None = field(
        default=None,
        metadata={
            "help": f"System prompt added to traces without one: a shipped name ({', '.join(SHIPPED_PROMPTS)}), "
            "a literal prompt, or none (default). Use the same one as in the RL stage."
        },
    )
    prompt_format: str = field(
        default="auto",
        metadata={
            "help": "Trace format: 'auto' (as the data are), 'conversational' (plain-text prompts become user "
            "messages, rendered with the chat template) or 'plain' (conversations are refused).",
            "choices": PROMPT_FORMAT_CHOICES,
        },
    )
    messages_column: str | None = field(default=None, metadata={"help": "Column with the conversations."})
    prompt_column: str | None = field(default=None, metadata={"help": "Column with the prompts."})
    completion_column: str | None = field(default=None, metadata={"help": "Column with the completions."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N traces."})
    console: str = console_field()


SFT_TRL_OPTIONS = (
    "output_dir dtype max_steps num_train_epochs learning_rate per_device_train_batch_size "
    "gradient_accumulation_steps max_length use_peft lora_r bf16 use_cpu logging_steps save_strategy report_to seed"
)


def sft_help() -> str:
    """The short `retool-trl sft --help` (imports neither torch nor TRL's trainers)."""
    from trl import ModelConfig

    from .train import MODEL_HELP

    return render_help(
        f"{PROG} sft",
        "Cold-start SFT on code-integrated traces; the interpreter's output is masked from the loss. Options come\n"
        "from --config FILE.yaml and the command line, which wins. Example: retool-trl sft --config "
        "configs/sft_cold_start.yaml",
        [
            (
                "model and data",
                [
                    "model_name_or_path",
                    "dataset_name",
                    "dataset_config",
                    "dataset_train_split",
                    "prompt_format",
                    "messages_column",
                    "prompt_column",
                    "completion_column",
                    "max_train_samples",
                ],
            ),
            (
                "text format",
                ["system_prompt", "call_format", "code_start", "code_end", "interpreter_start", "interpreter_end"],
            ),
            ("console", ["console"]),
        ],
        [SFTScriptArguments, ModelConfig],
        overrides={
            "model_name_or_path": MODEL_HELP,
            "dataset_name": "Traces: a hub id 'org/name' (e.g. JoeYing/ReTool-SFT) or a local .jsonl/.json/.parquet/"
            ".csv file, with a 'messages' column or 'prompt' and 'completion' columns.",
            "dataset_config": "Hub configuration of dataset_name.",
        },
        epilog=more_options(f"{PROG} sft", "SFTConfig", SFT_TRL_OPTIONS),
    )


def parse_sft_args(argv: Sequence[str]):
    """`(SFTScriptArguments, SFTConfig, ModelConfig)` from command-line arguments (and `--config`)."""
    from trl import ModelConfig, SFTConfig

    return parse_arguments((SFTScriptArguments, SFTConfig, ModelConfig), argv, f"{PROG} sft")


def _in_format(dataset, prompt_format: str, name: str):
    """Traces in the asked format: plain prompts become user messages for `conversational`; `plain` refuses
    conversations (they cannot be flattened without choosing a template)."""
    conversational = "messages" in dataset.column_names or not isinstance(dataset[0]["prompt"], str)
    if prompt_format == "plain" and conversational:
        raise UserError(
            f"dataset {name!r} holds conversations, which prompt_format: plain cannot train on; set "
            "prompt_format: auto or conversational."
        )
    if prompt_format == "conversational" and not conversational:
        dataset = dataset.map(
            lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]}, desc="Prompts as messages"
        )
        conversational = True
    if prompt_format == "auto":
        logger.info(
            "prompt_format auto: %s traces (as the data are).", "conversational" if conversational else "plain"
        )
    return dataset, conversational


def build_sft(argv: Sequence[str]):
    """Everything `retool-trl sft` does before `train()`: returns the `SFTTrainer` (user errors raised first)."""
    from trl import get_peft_config

    from ..data.adapters import is_local_dataset
    from ..data.loading import load_traces, with_trace_system_prompt
    from ..format.registry import get_format, resolve_system_prompt
    from ..models.names import check_hub_id
    from ..models.tokenizers import check_tokenizer, load_tokenizer
    from ..reporting.output_folder import check_output_dir
    from ..sft import build_sft_trainer

    script_args, sft_args, model_args = parse_sft_args(argv)
    check_output_dir(sft_args.output_dir)  # before anything is loaded
    model_path = resolve_model_path(model_args.model_name_or_path)
    if not script_args.dataset_name:
        raise UserError("no traces: set `dataset_name` (e.g. JoeYing/ReTool-SFT or a local .jsonl file).")
    if sft_args.completion_only_loss is False:
        raise UserError("completion_only_loss: false would train on prompt and interpreter tokens; remove it.")
    if sft_args.packing:
        raise UserError("packing: true is not supported for interpreter-masked traces; set packing: false.")
    resume_value(sft_args)  # checked now, before anything is loaded
    take_run_settings(argv, script_args, script_args, sft_args, model_path)
    if not is_local_dataset(script_args.dataset_name):
        check_hub_id(script_args.dataset_name, "dataset", "dataset_name")  # typos fail here, before any hub call
    tags = Tags.from_config(script_args)
    call_format = script_args.call_format
    fmt = get_format(call_format)
    template = sft_args.chat_template_path
    if template and template.endswith((".jinja", ".j2")) and os.path.isfile(template):
        # A template file is applied here, before the traces are tokenized with it (SFTTrainer would apply it again).
        # Another model's template stays TRL's to clone: it also adds that template's tokens to the model.
        tokenizer = load_tokenizer(model_path, model_args.model_revision, False, template)
        sft_args.chat_template_path = None
    else:
        tokenizer = load_tokenizer(model_path, model_args.model_revision, False)

    def traces(split, max_samples):
        dataset = load_traces(
            script_args.dataset_name,
            split,
            script_args.dataset_config,
            messages_column=script_args.messages_column,
            prompt_column=script_args.prompt_column,
            completion_column=script_args.completion_column,
            max_samples=max_samples,
        )
        return _in_format(dataset, script_args.prompt_format, script_args.dataset_name)

    train, conversational = traces(script_args.dataset_train_split, script_args.max_train_samples)
    check_tokenizer(
        tokenizer,
        model_path,
        fmt.written_tags(script_args),  # the tags the model itself will write
        sft_args.pad_token,
        needs_chat_template=f"call_format={fmt.name!r}" if fmt.needs_chat_template else conversational,
    )
    # A template the format cannot use (e.g. tool calls TRL cannot parse): refused now, in one line.
    fmt.from_config(script_args, tokenizer)
    system = resolve_system_prompt(script_args.system_prompt, tags, call_format)
    train = with_trace_system_prompt(train, system)
    eval_dataset = None
    if sft_args.eval_strategy != "no":
        eval_dataset = with_trace_system_prompt(traces(script_args.dataset_test_split or "test", None)[0], system)
    sft_args.model_init_kwargs = model_init_kwargs(model_args, sft_args.model_init_kwargs)
    try:
        trainer = build_sft_trainer(
            model_path,
            tokenizer,
            train,
            sft_args,
            tags=tags,
            eval_dataset=eval_dataset,
            peft_config=get_peft_config(model_args),
            call_format=call_format,
        )
    except ValueError as error:
        if isinstance(error, UserError) or "trace" in str(error) or "chat template" in str(error):
            raise UserError(one_line(error)) from None  # retool_trl.sft's messages about malformed traces
        raise
    set_console(trainer, script_args.console)
    trainer.add_callback(_recorder(script_args))
    trainer.retool_run_info = {  # what `retool-trl plot` titles the run with (see `finish`)
        "command": "retool-trl sft",
        "model": short_model_name(model_path),
        "dataset": script_args.dataset_name,
    }
    return trainer


def _recorder(script_args):
    """A callback that records the call format, tags and system prompt the model was cold-started in
    (`retool_prompt.json`) in each checkpoint and in the run folder, as `retool-trl train` does, so that `eval` and a
    later `train` of that model use them."""
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    from ..format.prompts import write_prompt_settings

    class RecordSettings(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                write_prompt_settings(
                    os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"), script_args
                )

        def on_train_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                write_prompt_settings(args.output_dir, script_args)

    return RecordSettings()


def main(argv: Sequence[str]) -> int:
    """`retool-trl sft [--config FILE.yaml] [--key value ...]`."""
    if wants_help(argv):
        print(sft_help().rstrip("\n"))
        return 0
    trainer = build_sft(help_all_argv(argv))
    trainer.train(resume_from_checkpoint=resume_value(trainer.args))
    finish(trainer, trainer.args.output_dir, trainer.retool_run_info)
    return 0
