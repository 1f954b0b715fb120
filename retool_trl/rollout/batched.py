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

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..format.calls import Call
from ..format.parsing import Tags, last_boxed
from ..format.tags import TagFormat
from ..sandbox import ExecResult, truncate_output
from .types import GenerationBackend, TurnOutput

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
class RolloutSpec:
    """Limits and format of a rollout (built from `ReToolConfig` by `RolloutSpec.from_config`).

    `max_model_len` is the engine's context limit (prompt + completion tokens), when there is one: a turn never asks
    for more tokens than the context has room for, and a completion that fills the context ends truncated, as one
    that reaches `max_completion_length` does.
    """

    max_completion_length: int
    eos_token_ids: Sequence[int]
    tags: Tags = field(default_factory=Tags)
    max_tool_calls: int = 8
    max_interpreter_output_chars: int = 1024
    interpreter_truncation: str = "middle"
    max_model_len: int | None = None
    # How the model calls the interpreter (`retool_trl.format.calls`); the tags format of `tags` when not given.
    call_format: object = None

    def __post_init__(self):
        if self.call_format is None:
            self.call_format = TagFormat(self.tags)

    @classmethod
    def from_config(
        cls, args, eos_token_ids: Sequence[int], max_model_len: int | None = None, call_format=None
    ) -> RolloutSpec:
        return cls(
            max_completion_length=args.max_completion_length,
            eos_token_ids=list(eos_token_ids),
            tags=Tags.from_config(args),
            max_tool_calls=args.max_tool_calls,
            max_interpreter_output_chars=args.max_interpreter_output_chars,
            interpreter_truncation=args.interpreter_truncation,
            max_model_len=max_model_len,
            call_format=call_format,
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
    # Turns that outlasted the user's request timeout (`vllm_request_timeout_s`); such a row is also `infra_failed`.
    num_engine_timeouts: list[int] = field(default_factory=list)

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
    engine_timeouts: int = 0
    void_turns: int = 0
    code_lines: int = 0
    turns: int = 0
    session: object = None
    cells: list[str] = field(default_factory=list)  # code run so far, replayed if the session must be replaced
    calls: int = 0  # calls made (run, or failed to parse)
    # Text the last turn's final token carried past its call (`</code>` completed by `><`): the next turn's start.
    carry: str = ""
    done: bool = False

    def budget(self, spec: RolloutSpec) -> int:
        """Tokens this completion may still take: what is left of `max_completion_length`, and of the engine's
        context (`max_model_len`), whichever is less."""
        room = spec.max_completion_length - len(self.completion_ids)
        if spec.max_model_len:
            room = min(room, spec.max_model_len - len(self.prompt_ids) - len(self.completion_ids))
        return room

    def append(self, ids: Sequence[int], mask_value: int, logprobs: Sequence[float] | None) -> None:
        self.completion_ids.extend(ids)
        self.mask.extend([mask_value] * len(ids))
        # Environment tokens were not sampled; 0.0 is a placeholder that the mask keeps out of every loss term.
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))

    def take_turn(self, out: TurnOutput, text: str, spec: RolloutSpec, eos: set[int]) -> list[Call]:
        """Appends a generated turn (`text` is its decoded tokens); returns the calls to run now, if any."""
        fmt = spec.call_format
        prefix = self.prompt_ids + self.completion_ids if fmt.calls_at_turn_end else None
        self.turns += 1
        self.append(out.token_ids, 1, out.logprobs)
        text, self.carry = self.carry + text, ""
        ended = not out.token_ids or out.token_ids[-1] in eos or out.finished
        # Out of budget or out of context: cut at the limit, the completion ends truncated (not a void turn).
        truncated = not ended and self.budget(spec) <= 0
        calls: list[Call] = []
        if fmt.calls_at_turn_end:  # the calls come with the end of the assistant turn (its end-of-turn token)
            if ended and not out.finished and out.token_ids[-1] in fmt.turn_end_ids:
                calls = fmt.calls(out.token_ids, prefix)
        elif not ended and not truncated and (split := fmt.split(text)) is not None:
            call_text, self.carry = split  # what the stop's last token carried belongs to the next turn
            calls = fmt.calls(call_text)
        if not truncated:  # a finished turn: void if it has neither a call nor an answer
            self.void_turns += not calls and last_boxed(fmt.model_prose(text)) is None
        room = spec.max_tool_calls - self.calls
        if truncated or (ended and not (calls and room > 0)):
            self.done = True
            return []
        # A stop without a call (or past the call limit) is plain text: the model continues. Calls of one turn past
        # the limit are answered without running (the template needs a result for each) and are not counted.
        skipped = Call(None, f"Error: not run: the limit of {spec.max_tool_calls} calls is reached.", counted=False)
        return calls[:room] + [skipped] * len(calls[room:]) if room > 0 else []

    def take_result(self, calls: list[Call], results: list[ExecResult], block_ids: list[int], spec: RolloutSpec):
        """Records a turn's calls and their results, and appends the ids the results insert (mask 0)."""
        for call, result in zip(calls, results, strict=True):
            if not call.counted:
                continue
            self.calls += 1
            self.errors += not result.ok
            if call.code is not None:
                self.code_lines += len([line for line in call.code.splitlines() if line.strip()])
                self.timeouts += bool(result.timed_out)
                self.infra_errors += result.infra_error
        room = self.budget(spec)
        self.append(block_ids[:room], 0, None)
        # Out of budget inside (or right after) the inserted results: the completion ends truncated.
        self.done = len(block_ids) >= room


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
            texts = _decode(tokenizer, [out.token_ids for out in outputs])
            pending: list[tuple[_Row, list[Call]]] = []
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
        for row in rows:
            if row.session is not None:
                row.session.close()
    prepare_next_rollout(sandbox, len(rows), spec)

    # Backends that split a turn into several requests (vLLM, per stop setting) count their own calls.
    engine_calls = getattr(backend, "engine_calls", turn_calls)
    return rollout_result(rows, tokenizer, spec, exec_seconds, have_logprobs, engine_calls)


def rollout_result(
    rows, tokenizer, spec: RolloutSpec, exec_seconds: list[float], have_logprobs: bool, engine_calls: int
) -> RolloutResult:
    """The finished rows as a `RolloutResult` (shared by the barrier and the async rollout)."""
    for row in rows:  # TRL reads the last token of every completion: never hand it an empty one
        if not row.completion_ids:
            row.append([spec.eos_token_ids[0]], 0, None)
    # Special tokens (EOS, padding) are dropped from the model's text, but not the tags, even where a tokenizer
    # registers them as special: reward functions must see where code blocks start and end.
    kept = spec.call_format.kept_texts
    tag_ids = {i for t in kept for i in tokenizer(t, add_special_tokens=False)["input_ids"]}
    drop = set(tokenizer.all_special_ids) - tag_ids
    model_ids = [[t for t, m in zip(r.completion_ids, r.mask) if m and t not in drop] for r in rows]
    return RolloutResult(
        completion_ids=[r.completion_ids for r in rows],
        interpreter_mask=[r.mask for r in rows],
        logprobs=[r.logprobs for r in rows] if have_logprobs else None,
        model_text=_decode(tokenizer, model_ids),
        num_tool_calls=[r.calls for r in rows],
        num_tool_errors=[r.errors for r in rows],
        num_tool_timeouts=[r.timeouts for r in rows],
        num_infra_errors=[r.infra_errors for r in rows],
        code_lines=[r.code_lines for r in rows],
        exec_seconds=exec_seconds,
        num_turns=[r.turns for r in rows],
        infra_failed=[r.infra_failed for r in rows],
        num_void_turns=[r.void_turns for r in rows],
        engine_calls=[engine_calls] * len(rows),
        num_engine_timeouts=[r.engine_timeouts for r in rows],
    )


def _decode(tokenizer, ids: list[list[int]]) -> list[str]:
    # Never ask the tokenizer about an empty batch: some transformers releases decode `[]` to `[""]`. A process can
    # have no active row in a turn that is collective across processes (vLLM server mode, ZeRO-3, FSDP).
    return tokenizer.batch_decode(ids, skip_special_tokens=False) if ids else []


def interpreter_blocks(tokenizer, outputs: list[str], spec: RolloutSpec) -> list[list[int]]:
    """The ids one raw sandbox output per row inserts (`result_blocks` with one call per row)."""
    return result_blocks(tokenizer, [[ExecResult(output, True, False, 0.0)] for output in outputs], spec)


def result_blocks(tokenizer, results: list[list[ExecResult]], spec: RolloutSpec) -> list[list[int]]:
    """The ids each row's results insert, in the call format's own rendering (`interpreter_start` + output +
    `interpreter_end`, an output fence, the template's tool messages).

    Each output is cleaned first (valid text, the format's markers defanged, so printed text can neither close the
    result early nor open a call) and truncated to `max_interpreter_output_chars`.
    """
    fmt = spec.call_format
    outputs = [
        [
            truncate_output(fmt.clean(result.output), spec.max_interpreter_output_chars, spec.interpreter_truncation)
            for result in row
        ]
        for row in results
    ]
    return fmt.result_ids(tokenizer, outputs) if outputs else []


def run_calls(sandbox, pending: Sequence[tuple[_Row, list[Call]]]) -> list[list[ExecResult]]:
    """Runs every row's calls of a turn: the rows' calls concurrently, one row's several calls in order in its
    session. A call that did not parse is not run: its result is the error the model is shown."""
    runnable = [(row, call.code) for row, calls in pending for call in calls if call.code is not None]
    ran = iter(run_cells(sandbox, runnable))
    return [
        [next(ran) if call.code is not None else ExecResult(call.error or "", False, False, 0.0) for call in calls]
        for _, calls in pending
    ]


def reserve_sessions(sandbox, n: int, spec: RolloutSpec) -> None:
    """Lets the sandbox prepare `n` sessions while the model generates their first turn (`reserve`, where the
    backend has one: a local sandbox forks jails in the background). Nothing when no code can run
    (`max_tool_calls=0`, a text-only run)."""
    reserve = getattr(sandbox, "reserve", None)
    if callable(reserve) and spec.max_tool_calls > 0:
        reserve(n)


def prepare_next_rollout(sandbox, n: int, spec: RolloutSpec) -> None:
    """Asks the sandbox, as a rollout ends, for the next rollout's `n` sessions: their jails then set up while the
    trainer scores and updates (on a GPU node, on host cores idle meanwhile), not during the next rollout's first
    turn, when a fast turn (a short first turn, a small model) would otherwise wait for them at its first code call.
    Jails nobody takes are released by the sandbox after a minute."""
    reserve_sessions(sandbox, n, spec)


def release_session(row: _Row) -> None:
    """Closes a finished completion's session now, not at the end of the rollout: its memory goes back to the rows
    still running."""
    if row.session is not None:
        row.session.close()


def _run_many(sandbox, pairs) -> list[ExecResult]:
    started = time.perf_counter()
    try:
        return list(sandbox.run_many(pairs))
    except Exception as exc:  # the sandbox itself failed: not the model's fault, and training must go on
        message = f"SandboxError: {type(exc).__name__}: {exc}"
        elapsed = time.perf_counter() - started
        return [ExecResult(output=message, ok=False, timed_out=False, duration_s=elapsed, infra_error=True)] * len(
            pairs
        )


def run_cells(sandbox, pending: Sequence[tuple[_Row, str]]) -> list[ExecResult]:
    """Runs each row's new cells in the row's session (opened on first use): different rows' cells concurrently
    (one `run_many`), a row's second cell after its first (rounds), so they run in order in one session.
    """
    results: list[ExecResult | None] = [None] * len(pending)
    left = list(range(len(pending)))
    while left:
        taken, now, later = set(), [], []
        for k in left:
            (later if id(pending[k][0]) in taken else now).append(k)
            taken.add(id(pending[k][0]))
        for k, result in zip(now, _run_round(sandbox, [pending[k] for k in now]), strict=True):
            results[k] = result
            pending[k][0].cells.append(pending[k][1])  # replayed, with the cells before it, if the session is lost
        left = later
    return results


def _run_round(sandbox, pending: Sequence[tuple[_Row, str]]) -> list[ExecResult]:
    """Runs one cell per row (concurrently, one `run_many`), in the row's session (opened on first use).

    Infrastructure failures (worker lost, service down) are retried once; the snippet's own errors never are. The
    failed session may be broken for good, so the retry gets a fresh one with the row's earlier cells replayed. A
    failure that survives the retry marks the row `infra_failed`.
    """
    for row, _ in pending:
        if row.session is None:
            row.session = sandbox.session()
    results = _run_many(sandbox, [(row.session, code) for row, code in pending])
    retry = [k for k, result in enumerate(results) if result.infra_error]
    if retry:
        pairs, last = [], []
        for k in retry:
            row, code = pending[k]
            row.session.close()
            row.session = sandbox.session()
            pairs += [(row.session, cell) for cell in row.cells] + [(row.session, code)]
            last.append(len(pairs) - 1)
        again = _run_many(sandbox, pairs)
        for k, j in zip(retry, last, strict=True):
            results[k] = again[j]
            pending[k][0].infra_failed |= again[j].infra_error
    return results
