r"""Cold-start SFT on code-integrated traces, with the interpreter's output excluded from the loss.

A trace is a prompt and a completion in which the interpreter's output sits between the interpreter tags:

    What is 843*13?\n  |  <code>print(843*13)</code><interpreter>10959\n</interpreter>\boxed{10959}<eos>
    ----- prompt -----    ------- model -------------  ----------- environment -----------  ---- model ----

Only model-written tokens are trained (`completion_mask` 1); the prompt and every `<interpreter>...</interpreter>`
block, tags included, get `completion_mask` 0. The model never writes interpreter output at RL time, so learning to
predict it would teach it to hallucinate results.

Traces are tokenized span by span and the ids concatenated, as the rollout does at RL time (prompt ids, then each
model turn, then each interpreter block tokenized on its own). Decoding and re-encoding the whole text would let
tokens merge across span boundaries and misalign the mask.

The tokenized dataset (`input_ids`, `completion_mask`) goes to TRL's `SFTTrainer`, which turns `completion_mask` into
`-100` labels when `completion_only_loss=True`; [`build_sft_trainer`] makes sure it is.
"""

from __future__ import annotations

import copy

from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from .format.parsing import Tags
from .format.registry import get_format


def split_environment_spans(completion: str, tags: Tags = Tags()) -> list[tuple[str, bool]]:
    """Splits a completion into `(text, trained)` spans: model text is trained, interpreter blocks are not.

    An interpreter block runs from `interpreter_start` to the matching `interpreter_end`, tags included; an unclosed
    one (a truncated trace) runs to the end. Whitespace between `code_end` and `interpreter_start` (common in released
    traces, e.g. `</code>\\n<interpreter>`) goes with the block: at RL time generation stops right after `code_end`,
    so the model never writes it.

    Args:
        completion (`str`): The completion text.
        tags (`Tags`): The text format's tags.

    Returns:
        List of `(text, trained)`, in order, non-empty texts only, concatenating back to `completion`.
    """
    spans: list[tuple[str, bool]] = []
    pos = 0
    while pos < len(completion):
        start = completion.find(tags.interpreter_start, pos)
        if start < 0:
            spans.append((completion[pos:], True))
            break
        model_text = completion[pos:start]
        stripped = model_text.rstrip()
        if stripped.endswith(tags.code_end):
            model_text = stripped  # the trailing whitespace is moved into the environment span
        env_start = pos + len(model_text)
        end = completion.find(tags.interpreter_end, start + len(tags.interpreter_start))
        env_end = len(completion) if end < 0 else end + len(tags.interpreter_end)
        spans.append((model_text, True))
        spans.append((completion[env_start:env_end], False))
        pos = env_end
    return [(text, trained) for text, trained in spans if text]


def _chat_parts(tokenizer, messages: list[dict], completion: str, chat_template_kwargs: dict):
    """Prompt ids of a conversation, plus the template text around the assistant content.

    The text the template puts after the assistant content (e.g. `<|im_end|>\\n`) is what teaches the model to stop,
    so it is trained, as in TRL's SFT.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "Conversational traces (`messages` or message-list `prompt`) need a tokenizer with a chat template; "
            "set `tokenizer.chat_template` or pass plain-text `prompt`/`completion` columns."
        )
    prompt_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, **chat_template_kwargs
    )["input_ids"]
    prefix = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **chat_template_kwargs
    )
    full = tokenizer.apply_chat_template(
        messages + [{"role": "assistant", "content": completion}], tokenize=False, **chat_template_kwargs
    )
    at = full.find(completion, len(prefix)) if full.startswith(prefix) else -1
    if at < 0:  # the template rewrites the assistant turn; fall back to ending it with EOS
        return prompt_ids, "", tokenizer.eos_token or ""
    return prompt_ids, full[len(prefix) : at], full[at + len(completion) :]


def tokenize_trace(
    tokenizer,
    prompt: str | list[dict],
    completion: str,
    tags: Tags = Tags(),
    add_eos: bool = True,
    chat_template_kwargs: dict | None = None,
) -> dict[str, list[int]]:
    r"""Tokenizes one trace span by span and marks which tokens the model is trained on.

    Args:
        tokenizer: The model's tokenizer.
        prompt (`str` or list of messages): Plain-text prompt (tokenized like TRL's GRPO does, with the tokenizer's
            special tokens), or the conversation before the assistant turn (rendered with the chat template and
            `add_generation_prompt=True`).
        completion (`str`): The assistant text, with code and interpreter blocks.
        tags (`Tags`): The text format's tags.
        add_eos (`bool`): For a plain-text prompt, end the completion with the EOS token (trained) so the model
            learns to stop. A conversational trace ends with the chat template's end of turn instead.
        chat_template_kwargs (`dict`, *optional*): Extra arguments for `apply_chat_template`.

    Returns:
        `{"input_ids": [...], "completion_mask": [...]}` of equal lengths; `completion_mask` is 1 on model-written
        tokens and 0 on prompt and interpreter tokens.
    """
    if isinstance(prompt, str):
        prompt_ids = list(tokenizer(prompt)["input_ids"])
        lead, tail = "", ""
        if add_eos and tokenizer.eos_token is not None and not completion.endswith(tokenizer.eos_token):
            tail = tokenizer.eos_token
    else:
        prompt_ids, lead, tail = _chat_parts(tokenizer, list(prompt), completion, chat_template_kwargs or {})
        prompt_ids = list(prompt_ids)
    spans = split_environment_spans(completion, tags)
    spans = [(lead, True)] * bool(lead) + spans + [(tail, True)] * bool(tail)
    input_ids, mask = list(prompt_ids), [0] * len(prompt_ids)
    for text, trained in spans:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        input_ids.extend(ids)
        mask.extend([int(trained)] * len(ids))
    return {"input_ids": input_ids, "completion_mask": mask}


def tokenize_tool_trace(
    tokenizer, prompt: str | list[dict], completion: str, tags: Tags = Tags(), chat_template_kwargs: dict | None = None
) -> dict[str, list[int]]:
    """Tokenizes a ReTool-style trace as native tool calls (`call_format='tool_call'`), as the rollout builds them
    (see [`tokenize_tool_messages`])."""
    from .format.tool_calls import TOOLS, to_tool_messages

    return tokenize_tool_messages(tokenizer, prompt, to_tool_messages(completion, tags), TOOLS, chat_template_kwargs)


def tokenize_tool_messages(
    tokenizer,
    prompt: str | list[dict],
    turns: list[dict],
    tools: list | None,
    chat_template_kwargs: dict | None = None,
) -> dict[str, list[int]]:
    """Tokenizes a completion given as chat messages (assistant turns with tool calls, `tool` results after them).

    The ids are the chat template's, taken turn by turn: each assistant turn up to its end-of-turn token is trained,
    the tool messages after it (to the next assistant header) are not, exactly the ids the rollout samples and
    inserts. The template must be prefix-preserving (each rendering extends the previous one).
    """
    kwargs = dict(chat_template_kwargs or {})
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

    def render(conversation, generation_prompt):
        return list(
            tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                add_generation_prompt=generation_prompt,
                tokenize=True,
                return_dict=False,
                **kwargs,
            )
        )

    input_ids = render(messages, True)
    mask = [0] * len(input_ids)
    for k, message in enumerate(turns):
        if message["role"] != "assistant":
            continue
        conversation = messages + turns[: k + 1]
        with_turn = render(conversation, False)
        ends = [i for i, t in enumerate(with_turn) if t == tokenizer.eos_token_id and i >= len(input_ids)]
        if with_turn[: len(input_ids)] != input_ids or not ends:
            raise ValueError(
                "the chat template does not render the trace's turns as prefixes of one another (it is not "
                "prefix-preserving): use TRL's training template (trl.chat_template_utils.get_training_chat_template)."
            )
        mask += [1] * (ends[0] + 1 - len(input_ids))
        input_ids = with_turn[: ends[0] + 1]
        following = k + 1
        while following < len(turns) and turns[following]["role"] == "tool":
            following += 1
        if following > k + 1:  # the tool messages, up to the next assistant header: the environment's ids
            with_tools = render(messages + turns[:following], True)
            if with_tools[: len(input_ids)] != input_ids:
                raise ValueError(
                    "the chat template is not prefix-preserving: use TRL's training template "
                    "(trl.chat_template_utils.get_training_chat_template)."
                )
            mask += [0] * (len(with_tools) - len(input_ids))
            input_ids = with_tools
    return {"input_ids": input_ids, "completion_mask": mask}


def _trace_of(example: dict) -> tuple[str | list[dict], str]:
    """(prompt, completion) of a dataset row in any supported format."""
    if "messages" in example and example["messages"] is not None:
        messages = list(example["messages"])
        if not messages or messages[-1].get("role") != "assistant":
            raise ValueError("Each `messages` trace must end with an assistant message (the trained completion).")
        return messages[:-1], messages[-1]["content"]
    if "prompt" in example and "completion" in example:
        completion = example["completion"]
        if not isinstance(completion, str):  # conversational completion: a list of assistant messages
            completion = "".join(m.get("content") or "" for m in completion)
        return example["prompt"], completion
    raise ValueError(
        f"SFT traces need a `messages` column or `prompt` and `completion` columns; got columns {sorted(example)}."
    )


def build_sft_dataset(
    dataset: Dataset,
    tokenizer,
    tags: Tags | None = None,
    add_eos: bool = True,
    num_proc: int | None = None,
    call_format: str = "tags",
) -> Dataset:
    """Tokenizes a dataset of traces into `input_ids` + `completion_mask` (see [`tokenize_trace`]).

    Args:
        dataset (`Dataset`): Traces as `prompt` + `completion` (plain text, or TRL's conversational prompt-completion
            format), or as `messages` (system/user/assistant, e.g. the ReTool-SFT release), where the last assistant
            message is the trained completion.
        tokenizer: The model's tokenizer.
        tags (`Tags` or any object with the four tag fields, e.g. `ReToolConfig`): Defaults to the paper's tags.
        add_eos (`bool`): See [`tokenize_trace`].
        num_proc (`int`, *optional*): Processes for `Dataset.map`.
        call_format (`str`): The call format to train (a registered name, see `retool_trl.format`): ReTool-style
            traces are rewritten in it (`CallFormat.sft_trace`); `tags` keeps them as they are.

    Returns:
        `Dataset` with columns `input_ids` and `completion_mask` only.
    """
    tags = Tags() if tags is None else Tags.from_config(tags) if not isinstance(tags, Tags) else tags
    fmt = get_format(call_format)

    def _tokenize(example):
        prompt, completion = _trace_of(example)
        trace = fmt.sft_trace(completion, tags)  # the trace as the model writes it in its call format
        if trace.messages is not None:
            return tokenize_tool_messages(tokenizer, prompt, trace.messages, fmt.tools)
        return tokenize_trace(tokenizer, prompt, trace.text, tags=trace.spans, add_eos=add_eos)

    return dataset.map(_tokenize, remove_columns=dataset.column_names, num_proc=num_proc, desc="Tokenizing traces")


def build_sft_trainer(
    model,
    tokenizer,
    train_dataset: Dataset,
    args: SFTConfig | None = None,
    tags: Tags | None = None,
    eval_dataset: Dataset | None = None,
    call_format: str = "tags",
    **trainer_kwargs,
) -> SFTTrainer:
    """An `SFTTrainer` whose loss ignores prompt and interpreter tokens.

    Args:
        model: Model instance or path, as for `SFTTrainer`.
        tokenizer: The model's tokenizer.
        train_dataset (`Dataset`): Raw traces (tokenized here with [`build_sft_dataset`]) or an already tokenized
            dataset with `input_ids` and `completion_mask`.
        args (`SFTConfig`, *optional*): Training settings. `completion_only_loss` must be `None` or `True`: it is what
            makes TRL apply `completion_mask`.
        tags (`Tags`, *optional*): Tags used to find interpreter blocks.
        eval_dataset (`Dataset`, *optional*): Like `train_dataset`.
        call_format (`str`): The call format to train (see [`build_sft_dataset`]).
        trainer_kwargs: Passed to `SFTTrainer` (callbacks, peft_config, ...).
    """
    args = SFTConfig(output_dir="retool-sft") if args is None else args
    if args.completion_only_loss is False:
        raise ValueError(
            "completion_only_loss=False would train on prompt and interpreter tokens; leave it unset (None) or True."
        )
    if args.completion_only_loss is None:
        args = copy.copy(args)  # do not mutate the caller's config
        # TRL only infers it for raw prompt/completion datasets; a tokenized one would otherwise train every token.
        args.completion_only_loss = True

    def _prepare(dataset):
        if dataset is None or "input_ids" in dataset.column_names:
            return dataset
        return build_sft_dataset(
            dataset, tokenizer, tags=tags, num_proc=args.dataset_num_proc, call_format=call_format
        )

    return SFTTrainer(
        model=model,
        args=args,
        train_dataset=_prepare(train_dataset),
        eval_dataset=_prepare(eval_dataset),
        processing_class=tokenizer,
        **trainer_kwargs,
    )


def run_sft(model, tokenizer, train_dataset: Dataset, args: SFTConfig | None = None, **kwargs) -> SFTTrainer:
    """Builds the trainer with [`build_sft_trainer`] (same arguments), trains, and returns the trainer."""
    trainer = build_sft_trainer(model, tokenizer, train_dataset, args, **kwargs)
    trainer.train()
    return trainer


def train_cold_start(
    model, tokenizer, dataset: Dataset, max_steps: int, batch_size: int, learning_rate: float, seed: int = 0
) -> tuple:
    """Cold-start SFT as the shipped quickstart checkpoints are built: cosine schedule, no checkpoints, on CPU unless
    a GPU is there. Returns the trained model (its generation config set to sample at T=1, as the quickstarts
    evaluate) and the final training loss.
    """
    import tempfile

    import torch

    with tempfile.TemporaryDirectory() as work_dir:
        config = SFTConfig(
            output_dir=work_dir,
            max_steps=max_steps,
            per_device_train_batch_size=batch_size,
            learning_rate=learning_rate,
            lr_scheduler_type="cosine",
            warmup_steps=50,
            weight_decay=0.0,
            adam_beta2=0.95,
            max_grad_norm=1.0,
            max_length=None,  # traces are short; nothing to truncate
            logging_steps=100,
            save_strategy="no",
            report_to="none",
            seed=seed,
            use_cpu=not torch.cuda.is_available(),
            bf16=False,
            dataloader_num_workers=0,
        )
        trainer = run_sft(model, tokenizer, dataset, config)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    final_loss = losses[-1] if losses else trainer.state.log_history[-1]["train_loss"]
    model = trainer.model
    model.generation_config.do_sample = True
    model.generation_config.temperature = 1.0
    return model, final_loss


def masked_token_stats(dataset: Dataset) -> dict[str, float]:
    """Share of trained tokens in a tokenized SFT dataset (a quick check that masking did what was meant)."""
    total = sum(len(m) for m in dataset["completion_mask"])
    trained = sum(sum(m) for m in dataset["completion_mask"])
    return {"tokens": float(total), "trained_fraction": trained / total if total else 0.0}


__all__ = [
    "split_environment_spans",
    "tokenize_trace",
    "build_sft_dataset",
    "build_sft_trainer",
    "run_sft",
    "masked_token_stats",
]
