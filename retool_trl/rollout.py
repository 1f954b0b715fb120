"""The interleaved code-interpreter rollout and its interpreter mask.

`interleaved_rollout` is a batched state machine over all completions of a batch:

1. generate for every active sequence until EOS, the code-end tag, or its token budget (one backend call per turn);
2. collect the code blocks that just closed, across the whole batch, and run them concurrently in the sandbox;
3. append `<interpreter>output</interpreter>` *token ids* to those sequences (mask 0) and resume only them.

Completions are built by concatenating token ids turn by turn, never by decoding and re-encoding the sequence, so the
interpreter mask (1 = sampled by the policy, 0 = inserted by the environment) is aligned with `completion_ids` by
construction. Generation backends (transformers `generate`, vLLM, scripted fakes in tests) implement
`GenerationBackend`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import astuple, dataclass, field
from typing import Protocol

from .parsing import Tags, extract_code, last_boxed, model_prose
from .sandbox import ExecResult, truncate_output

# Per-completion facts the trainer hands to reward functions as kwargs (TRL `extra_fields`).
ROLLOUT_FIELDS = (
    "model_text",
    "num_tool_calls",
    "num_tool_errors",
    "num_tool_timeouts",
    "num_infra_errors",
    "infra_failed",
    "num_void_turns",
)


@dataclass
class TurnOutput:
    """What a backend generated for one sequence in one turn.

    `token_ids` stop after the token that completes the code-end tag (when stopping there was requested), after an
    EOS token, or at the budget. `logprobs` are the sampling log-probabilities of those tokens, if the backend has them.
    """

    token_ids: list[int]
    logprobs: list[float] | None = None


class GenerationBackend(Protocol):
    def generate_turn(
        self, sequences: Sequence[Sequence[int]], max_new_tokens: Sequence[int], stop_at_code_end: Sequence[bool]
    ) -> list[TurnOutput]:
        """Continues each token sequence (prompt + completion so far) for at most `max_new_tokens[i]` tokens."""
        ...


@dataclass
class RolloutSpec:
    """Limits and format of a rollout (built from `ReToolConfig` by `RolloutSpec.from_config`)."""

    max_completion_length: int
    eos_token_ids: Sequence[int]
    tags: Tags = field(default_factory=Tags)
    max_tool_calls: int = 8
    max_interpreter_output_chars: int = 1024
    interpreter_truncation: str = "middle"

    @classmethod
    def from_config(cls, args, eos_token_ids: Sequence[int]) -> RolloutSpec:
        return cls(
            max_completion_length=args.max_completion_length,
            eos_token_ids=list(eos_token_ids),
            tags=Tags.from_config(args),
            max_tool_calls=args.max_tool_calls,
            max_interpreter_output_chars=args.max_interpreter_output_chars,
            interpreter_truncation=args.interpreter_truncation,
        )


@dataclass
class RolloutResult:
    """Token-level result of a rollout, one entry per sequence (TRL's `_generate` contract plus ReTool facts)."""

    completion_ids: list[list[int]]
    interpreter_mask: list[list[int]]
    logprobs: list[list[float]] | None
    model_text: list[str]
    num_tool_calls: list[int]
    num_tool_errors: list[int]
    num_tool_timeouts: list[int]
    num_infra_errors: list[int]
    code_lines: list[int]
    exec_seconds: list[float] = field(default_factory=list)  # one per executed snippet, for latency metrics
    num_turns: list[int] = field(default_factory=list)
    # A call failed for the sandbox's own reasons even after one retry: not the model's fault.
    infra_failed: list[bool] = field(default_factory=list)
    # Finished turns with neither a complete code block nor a \boxed{} answer (SimpleTIR's "void" turns).
    num_void_turns: list[int] = field(default_factory=list)
    # Engine calls (batched generate requests) of the rollout each completion came from: the same for all its rows.
    engine_calls: list[int] = field(default_factory=list)

    def extra_fields(self) -> dict[str, list]:
        return {name: getattr(self, name) for name in ROLLOUT_FIELDS}

    @classmethod
    def concatenate(cls, parts: Sequence[RolloutResult]) -> RolloutResult:
        """Joins the results of consecutive batches."""
        merged = {}
        for name in cls.__dataclass_fields__:
            values = [getattr(part, name) for part in parts]
            merged[name] = None if any(v is None for v in values) else [x for v in values for x in v]
        return cls(**merged)


@dataclass
class _Row:
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    errors: int = 0
    timeouts: int = 0
    infra_errors: int = 0
    infra_failed: bool = False
    void_turns: int = 0
    code_lines: int = 0
    turns: int = 0
    session: object = None
    cells: list[str] = field(default_factory=list)  # code run so far, replayed if the session must be replaced
    done: bool = False

    @property
    def calls(self) -> int:
        return len(self.cells)

    def append(self, ids: Sequence[int], mask_value: int, logprobs: Sequence[float] | None) -> None:
        self.completion_ids.extend(ids)
        self.mask.extend([mask_value] * len(ids))
        # Environment tokens were not sampled; 0.0 is a placeholder that the mask keeps out of every loss term.
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))


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
    rows = [_Row(list(ids)) for ids in prompt_ids]
    eos = set(spec.eos_token_ids)
    exec_seconds: list[float] = []
    have_logprobs = True
    turn_calls = 0
    try:
        active = list(range(len(rows)))
        # Backends whose calls are collective across processes (vLLM server mode) keep every process in the loop.
        any_active = getattr(backend, "any_active", bool)
        while any_active(bool(active)):
            outputs = backend.generate_turn(
                [rows[i].prompt_ids + rows[i].completion_ids for i in active],
                [spec.max_completion_length - len(rows[i].completion_ids) for i in active],
                [rows[i].calls < spec.max_tool_calls for i in active],
            )
            turn_calls += 1
            # Guarded: some tokenizers decode an empty batch to [''] (a process left with no active row).
            texts = tokenizer.batch_decode([o.token_ids for o in outputs], skip_special_tokens=False) if outputs else []
            pending: list[tuple[int, str]] = []
            for i, out, text in zip(active, outputs, texts, strict=True):
                row = rows[i]
                row.turns += 1
                have_logprobs &= out.logprobs is not None
                row.append(out.token_ids, 1, out.logprobs)
                code = extract_code(text, spec.tags)
                ended = not out.token_ids or out.token_ids[-1] in eos
                truncated = not ended and len(row.completion_ids) >= spec.max_completion_length
                if not truncated:  # a finished turn: void if it has neither code nor an answer
                    row.void_turns += code is None and last_boxed(model_prose(text, spec.tags)) is None
                if ended or truncated:
                    row.done = True
                elif row.calls < spec.max_tool_calls and code is not None:
                    pending.append((i, code))
                # else: a code-end tag without an open code block is plain text; the model just continues.
            _execute(rows, pending, sandbox, tokenizer, spec, exec_seconds)
            active = [i for i in active if not rows[i].done]
    finally:
        if hasattr(backend, "finish"):  # let the backend free what it kept between turns (e.g. a KV cache)
            backend.finish()
        for row in rows:
            if row.session is not None:
                row.session.close()

    for row in rows:  # TRL reads the last token of every completion: never hand it an empty one
        if not row.completion_ids:
            row.append([spec.eos_token_ids[0]], 0, None)
    # Special tokens (EOS, padding) are dropped from the model's text, but not the tags, even where a tokenizer
    # registers them as special: reward functions must see where code blocks start and end.
    tag_ids = {i for t in astuple(spec.tags) for i in tokenizer(t, add_special_tokens=False)["input_ids"]}
    drop = set(tokenizer.all_special_ids) - tag_ids
    model_ids = [[t for t, m in zip(r.completion_ids, r.mask) if m and t not in drop] for r in rows]
    return RolloutResult(
        completion_ids=[r.completion_ids for r in rows],
        interpreter_mask=[r.mask for r in rows],
        logprobs=[r.logprobs for r in rows] if have_logprobs else None,
        model_text=tokenizer.batch_decode(model_ids, skip_special_tokens=False),
        num_tool_calls=[r.calls for r in rows],
        num_tool_errors=[r.errors for r in rows],
        num_tool_timeouts=[r.timeouts for r in rows],
        num_infra_errors=[r.infra_errors for r in rows],
        code_lines=[r.code_lines for r in rows],
        exec_seconds=exec_seconds,
        num_turns=[r.turns for r in rows],
        infra_failed=[r.infra_failed for r in rows],
        num_void_turns=[r.void_turns for r in rows],
        # Backends that split a turn into several requests (vLLM, per stop setting) count their own calls.
        engine_calls=[getattr(backend, "engine_calls", turn_calls)] * len(rows),
    )


def _encode_interpreter_blocks(tokenizer, outputs: list[str], tags: Tags) -> list[list[int]]:
    """Token ids of `interpreter_start + output + interpreter_end` for each output.

    The output is encoded on its own with `split_special_tokens`, so text such as `<|endoftext|>` printed by code
    stays text and never becomes a control token; the tags are encoded as the tokenizer defines them.
    """
    start, end = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in (tags.interpreter_start, tags.interpreter_end))
    bodies = tokenizer(outputs, add_special_tokens=False, split_special_tokens=True)["input_ids"] if outputs else []
    return [[*start, *body, *end] for body in bodies]


def _run_many(sandbox, pairs) -> list[ExecResult]:
    started = time.perf_counter()
    try:
        return list(sandbox.run_many(pairs))
    except Exception as exc:  # the sandbox itself failed: not the model's fault, and training must go on
        message = f"SandboxError: {type(exc).__name__}: {exc}"
        elapsed = time.perf_counter() - started
        return [ExecResult(output=message, ok=False, timed_out=False, duration_s=elapsed, infra_error=True)] * len(pairs)


def _execute(rows, pending, sandbox, tokenizer, spec: RolloutSpec, exec_seconds: list[float]) -> None:
    """Runs the batch's pending snippets concurrently and appends each interpreter block (mask 0)."""
    if not pending:
        return
    for i, _ in pending:
        if rows[i].session is None:
            rows[i].session = sandbox.session()
    results = _run_many(sandbox, [(rows[i].session, code) for i, code in pending])
    # Infrastructure failures (worker lost, service down) are retried once; the snippet's own errors never are.
    # The failed session may be broken for good, so the retry gets a fresh one with the earlier cells replayed.
    retry = [k for k, result in enumerate(results) if result.infra_error]
    if retry:
        pairs, last = [], []
        for k in retry:
            row = rows[pending[k][0]]
            row.session.close()
            row.session = sandbox.session()
            pairs += [(row.session, cell) for cell in row.cells] + [(row.session, pending[k][1])]
            last.append(len(pairs) - 1)
        again = _run_many(sandbox, pairs)
        for k, j in zip(retry, last, strict=True):
            results[k] = again[j]
            rows[pending[k][0]].infra_failed |= again[j].infra_error
    blocks = []
    for (i, code), result in zip(pending, results, strict=True):
        row = rows[i]
        row.cells.append(code)
        row.code_lines += len([line for line in code.splitlines() if line.strip()])
        row.errors += not result.ok
        row.timeouts += bool(result.timed_out)
        row.infra_errors += result.infra_error
        exec_seconds.append(result.duration_s)
        blocks.append(truncate_output(result.output, spec.max_interpreter_output_chars, spec.interpreter_truncation))
    encoded = _encode_interpreter_blocks(tokenizer, blocks, spec.tags)
    for (i, _), ids in zip(pending, encoded, strict=True):
        row = rows[i]
        room = spec.max_completion_length - len(row.completion_ids)
        row.append(ids[:room], 0, None)
        # Out of budget inside (or right after) the interpreter block: the completion ends truncated.
        row.done = len(ids) >= room
