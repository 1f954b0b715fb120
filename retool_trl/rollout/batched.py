"""The interleaved code-interpreter rollout and its interpreter mask.

`interleaved_rollout` is a batched state machine over all completions of a batch:

1. generate for every active sequence until EOS, the code-end tag, or its token budget (one backend call per turn);
2. collect the code blocks that just closed, across the whole batch, and run them concurrently in the sandbox;
3. append the results' *token ids* to those sequences (mask 0) and resume only them.

What a call looks like is the call format's business (`spec.call_format`, `retool_trl.format.calls`): where a turn's
call ends, what code it carries, what ids its results insert (`<interpreter>output</interpreter>` for the tags).

Completions are built by concatenating token ids turn by turn, never by decoding and re-encoding the sequence, so the
interpreter mask (1 = sampled by the policy, 0 = inserted by the environment) is aligned with `completion_ids` by
construction. Generation backends (transformers `generate`, vLLM, scripted fakes in tests) implement
`GenerationBackend`.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..format.calls import Call
from .cells import close_sessions, prepare_next_rollout, release_session, reserve_sessions, run_calls
from .rows import Row, decode, result_blocks, rollout_result
from .spec import ROLLOUT_FIELDS, RolloutResult, RolloutSpec
from .types import GenerationBackend

# Where the rollout's contract was first defined: `from retool_trl.rollout.batched import RolloutSpec` keeps working.
__all__ = ["ROLLOUT_FIELDS", "RolloutResult", "RolloutSpec", "interleaved_rollout"]


def interleaved_rollout(
    prompt_ids: Sequence[Sequence[int]],
    backend: GenerationBackend,
    sandbox,
    tokenizer,
    spec: RolloutSpec,
) -> RolloutResult:
    """Generates one completion per prompt, running the code the model writes and splicing its output back in.

    Args:
        prompt_ids: Token ids of each prompt (already repeated per generation).
        backend: Generates one turn for a batch of sequences (`GenerationBackend`).
        sandbox: A `retool_trl.sandbox` backend (`session()`, `run_many([(session, code), ...])`).
        tokenizer: Decodes turns (to find code) and encodes interpreter blocks.
        spec: Limits and tags.
    """
    rows = [Row(list(ids)) for ids in prompt_ids]
    eos = set(spec.eos_token_ids)
    exec_seconds: list[float] = []
    have_logprobs = True
    turn_calls = 0
    reserve_sessions(sandbox, len(rows), spec)
    try:
        for row in rows:  # a prompt that fills the context leaves nothing to generate
            row.done = row.budget(spec) <= 0
        active = [i for i, row in enumerate(rows) if not row.done]
        # Backends whose calls are collective across processes (vLLM server mode) keep every process in the loop.
        any_active = getattr(backend, "any_active", bool)
        while any_active(bool(active)):
            outputs = backend.generate_turn(
                [rows[i].prompt_ids + rows[i].completion_ids for i in active],
                [rows[i].budget(spec) for i in active],
                [rows[i].calls < spec.max_tool_calls for i in active],
            )
            turn_calls += 1
            texts = decode(tokenizer, [out.token_ids for out in outputs])
            pending: list[tuple[Row, list[Call]]] = []
            for i, out, text in zip(active, outputs, texts, strict=True):
                if out.aborted:  # the engine gave the turn up: unscored (`infra_failed`), as in the async loop
                    rows[i].infra_errors += 1
                    rows[i].infra_failed = rows[i].done = True
                    continue
                have_logprobs &= out.logprobs is not None
                calls = rows[i].take_turn(out, text, spec, eos)
                if calls:
                    pending.append((rows[i], calls))
            if pending:
                results = run_calls(sandbox, pending)
                blocks = result_blocks(tokenizer, results, spec)
                for (row, calls), row_results, block in zip(pending, results, blocks, strict=True):
                    row.take_result(calls, row_results, block, spec)
                    exec_seconds += [
                        r.duration_s for r, c in zip(row_results, calls, strict=True) if c.code is not None
                    ]
            for i in active:
                if rows[i].done:
                    release_session(rows[i])
            active = [i for i in active if not rows[i].done]
    finally:
        if hasattr(backend, "finish"):  # let the backend free what it kept between turns (e.g. a KV cache)
            backend.finish()
        close_sessions(rows)
    prepare_next_rollout(sandbox, len(rows), spec)

    # Backends that split a turn into several requests (vLLM, per stop setting) count their own calls.
    engine_calls = getattr(backend, "engine_calls", turn_calls)
    return rollout_result(rows, tokenizer, spec, exec_seconds, have_logprobs, engine_calls)
