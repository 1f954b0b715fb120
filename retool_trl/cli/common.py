"""What several commands share: the model path, resuming, the model's init kwargs, the prompt format, saving."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from ..errors import UserError

logger = logging.getLogger("retool_trl.cli")

PROG = "retool-trl"
PROMPT_FORMAT_HELP = (
    "Prompt format: 'conversational' (messages + chat template), 'plain' text, or 'auto': conversational when the "
    "data are conversations or the tokenizer has a chat template, plain text otherwise."
)
PROMPT_FORMAT_CHOICES = ["auto", "conversational", "plain"]
CONSOLE_CHOICES = ["compact", "dicts"]


def console_field():
    """The `console` option of the training commands (`train`, `sft`), as a dataclass field."""
    from dataclasses import field

    return field(
        default="compact",
        metadata={
            "help": "Console output while training: 'compact' (a progress line with the key numbers; every log goes "
            "to OUTPUT_DIR/log.jsonl) or 'dicts' (TRL's full log dict at every logging step).",
            "choices": CONSOLE_CHOICES,
        },
    )


CHAT_TEMPLATE_PATH_HELP = (
    "A chat template to use instead of the tokenizer's: a Jinja file (.jinja, .j2), or a tokenizer folder or hub id "
    "that has one. Give evaluation the same template as training (a trained model's folder already carries it)."
)


def set_console(trainer, console: str) -> None:
    """The training console: `compact` replaces TRL's log dicts with
    [`~retool_trl.reporting.console.CompactProgressCallback`] (every log also in `OUTPUT_DIR/log.jsonl`); `dicts` keeps
    transformers' own callbacks."""
    if console == "compact":
        from ..reporting.console import use_compact_console

        use_compact_console(trainer, os.path.join(trainer.args.output_dir, "log.jsonl"))


def resolve_model_path(name: str | None, option: str = "model_name_or_path") -> str:
    """A model folder (a run folder's `model/`) or hub id; `quickstart` is the tiny model shipped with the package
    (see `retool_trl.models.names`). A hub id not in the cache fails at once when the hub cannot be reached."""
    from ..models.names import check_hub_reachable, resolve_model

    path = resolve_model(name, option)
    if not os.path.exists(path):  # a hub id: one that cannot be fetched fails now, in seconds
        check_hub_reachable(path, option)
        return path
    # Absolute: the path is recorded with the model (a LoRA adapter's base), and read again from other folders.
    return os.path.abspath(path)


def model_init_kwargs(model_args, config_kwargs) -> dict:
    """The `from_pretrained` kwargs of TRL's `ModelConfig`, overridden by the trainer config's `model_init_kwargs`."""
    kwargs = dict(
        revision=model_args.model_revision, attn_implementation=model_args.attn_implementation, dtype=model_args.dtype
    )
    kwargs.update(config_kwargs or {})
    return kwargs


def resume_value(training_args):
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
            raise UserError(
                f"resume_from_checkpoint=true but {out!r} has no checkpoint-* folder; give a checkpoint "
                "path or start without resume_from_checkpoint."
            )
    elif value and not os.path.isdir(value):
        raise UserError(f"resume_from_checkpoint: checkpoint folder {value!r} does not exist.")
    return value or None


def given_options(argv: Sequence[str]) -> set[str]:
    """The options set on the command line (`--name value`, `--name=value`, dashes or underscores) or in the
    `--config` file."""
    names = {arg[2:].split("=", 1)[0].replace("-", "_") for arg in argv if arg.startswith("--")}
    if "config" in names:
        import yaml

        args = list(argv)
        at = next(i for i, arg in enumerate(args) if arg.split("=", 1)[0] == "--config")
        path = args[at].split("=", 1)[1] if "=" in args[at] else args[at + 1]
        with open(path) as handle:  # already read (and checked) by the parser
            names |= set(yaml.safe_load(handle) or {})
    return names


def take_trained_prompt_settings(model_path: str, script_args, config, given: set[str]) -> dict:
    """Prompts and interpreter as the model was trained: the settings a model saved by `retool-trl train` or `sft`
    records (`retool_prompt.json`: call format, system prompt, tags, chat template arguments, prompt format, how the
    interpreter answered) replace the defaults of the options not given (`given`). `script_args` holds
    `prompt_format`, `config` the rest. Returns what was taken (and says so on one line)."""
    from ..format.prompts import PROMPT_SETTINGS, read_prompt_settings
    from ..format.registry import FORMAT_NAMES

    recorded = read_prompt_settings(model_path) if os.path.isdir(model_path) else {}
    taken = {}
    for name, value in recorded.items():
        if name in given:
            continue
        if name == "call_format" and value not in FORMAT_NAMES:  # e.g. a plugin's format not installed here
            raise UserError(
                f"{os.path.join(model_path, PROMPT_SETTINGS)} records call_format={value!r}, which is not a call "
                f"format here ({', '.join(FORMAT_NAMES)}): install the package that provides it, or set --call_format."
            )
        if name == "prompt_format" and value in PROMPT_FORMAT_CHOICES:
            taken[name] = script_args.prompt_format = value
        elif name != "prompt_format" and hasattr(config, name) and value != getattr(config, name):
            taken[name] = value
            setattr(config, name, value)
    if taken:
        shown = ", ".join(f"{k}={v!r}" if len(repr(v)) < 40 else f"{k}=(as trained)" for k, v in taken.items())
        print(f"Prompt settings as in training ({os.path.join(model_path, PROMPT_SETTINGS)}): {shown}", flush=True)
    return taken


def take_run_settings(argv: Sequence[str], script_args, config, run_args, model_path: str) -> dict:
    """`retool-trl train` and `sft`: the settings the model was trained with, where the user did not set them.

    A resumed run takes them from its checkpoint and keeps its call format: another one is refused in one line (the
    checkpoint's model writes its own format, and the run's recorded format would be rewritten). A new run takes
    them from the model folder (a cold-started model records the format it learnt). `config` holds `call_format`
    and the rest, `script_args` the `prompt_format`, `run_args` (the trainer's config) `resume_from_checkpoint` and
    `output_dir`. Returns what was taken (said on one line)."""
    from transformers.trainer_utils import get_last_checkpoint

    from ..format.prompts import read_prompt_settings

    given = given_options(argv)
    checkpoint = resume_value(run_args)
    if checkpoint is True:
        checkpoint = get_last_checkpoint(run_args.output_dir)
    if checkpoint:
        recorded = read_prompt_settings(checkpoint).get("call_format")
        if recorded and "call_format" in given and recorded != config.call_format:
            raise UserError(
                f"resume_from_checkpoint: {checkpoint} was trained with call_format={recorded!r}, and this run sets "
                f"{config.call_format!r}; a run keeps its call format: resume with call_format: {recorded}, or start "
                "a new run in another output_dir."
            )
    return take_trained_prompt_settings(checkpoint or model_path, script_args, config, given)


def data_prompt_format(prompt_format: str, tokenizer) -> str:
    """The format to load problems with: `auto` becomes conversational when the tokenizer has a chat template, and
    otherwise stays `auto` (the data decide: conversations stay conversations, text stays text)."""
    if prompt_format == "auto" and getattr(tokenizer, "chat_template", None):
        return "conversational"
    return prompt_format


def report_prompt_format(requested: str, dataset, tokenizer, source: str) -> str:
    """The format the loaded problems have; logs the choice `auto` made, and fails when conversations meet a tokenizer
    without a chat template."""
    from ..data.loading import is_conversational

    chosen = "conversational" if is_conversational(dataset) else "plain"
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if requested == "auto":
        why = (
            "the tokenizer has a chat template"
            if has_template
            else "the data are conversations"
            if chosen == "conversational"
            else "the tokenizer has no chat template and the data are plain text"
        )
        logger.info("prompt_format auto: %s prompts (%s).", chosen, why)
    if chosen == "conversational" and not has_template:
        raise UserError(
            f"the tokenizer of {source} has no chat template, which conversational prompts need: set "
            "`prompt_format: plain`, or use a model whose tokenizer has a chat template."
        )
    return chosen


def short_model_name(path: str) -> str:
    """A model's name for titles: a folder's own name, or the hub id."""
    return os.path.basename(os.path.normpath(path)) if os.path.isdir(path) else path


def finish(trainer, output_dir: str, info: dict | None = None) -> None:
    """Saves the model, the log history and `info` (what the run was: `retool_run.json`, for the titles of
    `retool-trl plot`) and closes the trackers."""
    from ..reporting.run_logs import write_run_info

    trainer.save_model(output_dir)
    trainer.save_state()  # trainer_state.json (the log history) next to the model, for `retool-trl plot`
    if info is not None and trainer.is_world_process_zero():
        write_run_info(output_dir, seed=trainer.args.seed, **info)
    end = getattr(trainer, "end", None)  # transformers >= 5.18: closes the trackers of report_to
    if callable(end):
        end()
    trainer.accelerator.print(f"Model saved to {output_dir}")
