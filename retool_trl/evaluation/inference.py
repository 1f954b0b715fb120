"""Generation with the interpreter outside training (evaluation, demos), using the same rollout as the trainer."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import GenerationConfig

from ..data.prompt_ids import tokenize_prompts
from ..format.registry import format_of
from ..rollout.batched import interleaved_rollout
from ..rollout.engines.transformers_generate import TransformersBackend
from ..rollout.spec import RolloutResult, RolloutSpec
from ..sandbox.factory import sandbox_from_config, with_cell_limits
from ..training.sandbox_health import SandboxHealth


def eos_token_ids_of(model, tokenizer) -> list[int]:
    """The tokenizer's EOS plus the model's own end-of-turn ids (e.g. `<|im_end|>`), as TRL collects them."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = configured if isinstance(configured, list) else [configured]
    return [tokenizer.eos_token_id, *(i for i in configured if i is not None and i != tokenizer.eos_token_id)]


def generation_config_from(args, tokenizer, eos_token_ids: Sequence[int]) -> GenerationConfig:
    """The sampling settings of a `GRPOConfig` as a transformers `GenerationConfig` (as TRL builds it)."""
    kwargs = dict(
        max_new_tokens=args.max_completion_length,
        do_sample=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=list(eos_token_ids),
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
    )
    kwargs.update(args.generation_kwargs or {})
    return GenerationConfig(**kwargs)


def generate_with_interpreter(
    model, tokenizer, prompts: Sequence, args, sandbox=None, batch_size: int = 64, health: SandboxHealth | None = None
) -> RolloutResult:
    """Samples one completion per prompt with code execution, exactly as `ReToolTrainer` rolls out.

    Args:
        model: A causal LM (in eval mode is best).
        tokenizer: Its tokenizer.
        prompts: Plain strings or conversations (lists of messages); repeat a prompt to sample it several times.
        args: A `ReToolConfig` (tags, limits, sampling settings, sandbox).
        sandbox: A sandbox to reuse; by default one is built from `args` and closed afterwards.
        batch_size: Sequences generated together.
        health: The sandbox's watch to carry on (a caller that calls this chunk by chunk on one sandbox passes one,
            so the sandbox is probed before the first chunk only); by default a new one.

    Raises:
        `SandboxUnavailableError`: The sandbox cannot run a trivial cell, or every call of a batch failed in it.
    """
    eos_token_ids = eos_token_ids_of(model, tokenizer)
    call_format = format_of(args).from_config(args, tokenizer)
    spec = RolloutSpec.from_config(args, eos_token_ids, call_format=call_format)
    backend = TransformersBackend(
        model, tokenizer, generation_config_from(args, tokenizer, eos_token_ids), call_format.stop, eos_token_ids
    )
    prompt_ids = tokenize_prompts(tokenizer, prompts, args)
    own_sandbox = sandbox is None
    sandbox = sandbox_from_config(args) if own_sandbox else with_cell_limits(sandbox, args)
    # A sandbox that cannot run code stops the evaluation (`SandboxUnavailableError`) rather than score every
    # completion as if the model had not used the interpreter.
    health = health or SandboxHealth("evaluation")
    watched = health.watch(sandbox)
    parts = []
    try:
        for i in range(0, len(prompt_ids), batch_size):
            with health.step(watched, spec.max_tool_calls > 0):
                parts.append(interleaved_rollout(prompt_ids[i : i + batch_size], backend, watched, tokenizer, spec))
    finally:
        if own_sandbox:
            sandbox.close()
    return RolloutResult.concatenate(parts)
