"""The token ids of a batch of prompts, exactly as `ReToolTrainer` builds them for training.

Training, evaluation and SFT checks all need a prompt's ids, and all must get the same ones: a system prompt added
where a conversation has none, the chat template with its generation prompt and the configured template kwargs, and
with the `tool_call` format the tool's description. `tokenize_prompts` calls TRL's own `_tokenize_prompts` for it,
so no copy of TRL's logic can drift from it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..format.parsing import with_system_prompt
from ..format.registry import format_of


def tokenize_prompts(tokenizer, prompts: Sequence, args) -> list[list[int]]:
    """The prompt ids `ReToolTrainer` trains on for `prompts` under `args`, built by TRL's own `_tokenize_prompts`.

    Plain-text prompts go through the tokenizer; conversations get the configured system prompt where they have none,
    then the chat template with the generation prompt and `args.chat_template_kwargs` (e.g. Qwen3's
    `enable_thinking`). Calling TRL's function (not a copy of it) keeps evaluation's prompts identical to training's.

    Args:
        tokenizer: The model's tokenizer (with the chat template used in training).
        prompts: Plain strings or conversations (lists of messages).
        args: A `ReToolConfig` (system prompt, `chat_template_kwargs`); a string (or `None`) is taken as the system
            prompt alone, as earlier versions of this function took it.
    """
    from types import SimpleNamespace

    if args is None or isinstance(args, str):
        args = SimpleNamespace(resolved_system_prompt=args, chat_template_kwargs=None)
    from trl import GRPOTrainer

    # The attributes `_tokenize_prompts` reads, as a GRPOTrainer without environments sets them; with the
    # `tool_call` format, its tool (the template writes the tool's instructions into the prompt).
    trainer_view = SimpleNamespace(
        processing_class=tokenizer,
        _is_vlm=False,
        environment_factories=None,
        tools=format_of(args).tools,
        chat_template=None,
        chat_template_kwargs=args.chat_template_kwargs or {},
    )
    prompt_ids, _, _ = GRPOTrainer._tokenize_prompts(
        trainer_view, with_system_prompt(list(prompts), args.resolved_system_prompt)
    )
    return [list(ids) for ids in prompt_ids]
