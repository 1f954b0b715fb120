"""One completion's state as it goes turn by turn (`Row`), and how finished rows become a `RolloutResult`.

Both loops drive the same rows: the batched loop a batch of them turn by turn, the async loop each one on its own. A
row takes a generated turn (finding its calls), then the ids its results insert (mask 0), so the interpreter mask is
aligned with the completion's ids by construction; `result_blocks` renders those results in the call format's way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..format.calls import Call
from ..format.parsing import last_boxed
from ..sandbox import ExecResult, truncate_output
from .spec import RolloutResult, RolloutSpec
from .types import TurnOutput


@dataclass
class Row:
    """One completion in progress: its ids, mask and log-probs so far, its call counts, and its sandbox session."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    kept: list[list[int] | None] = field(default_factory=list)  # each token's kept set (sampling-mask replay)
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

    def append(
        self, ids: Sequence[int], mask_value: int, logprobs: Sequence[float] | None, kept: Sequence | None = None
    ) -> None:
        self.completion_ids.extend(ids)
        self.mask.extend([mask_value] * len(ids))
        # Environment tokens were not sampled; 0.0 is a placeholder that the mask keeps out of every loss term.
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.kept.extend(kept if kept is not None else [None] * len(ids))

    def take_turn(self, out: TurnOutput, text: str, spec: RolloutSpec, eos: set[int]) -> list[Call]:
        """Appends a generated turn (`text` is its decoded tokens); returns the calls to run now, if any."""
        fmt = spec.call_format
        prefix = self.prompt_ids + self.completion_ids if fmt.calls_at_turn_end else None
        self.turns += 1
        self.append(out.token_ids, 1, out.logprobs, out.kept)
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
        model_text=decode(tokenizer, model_ids),
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
        # Only where the engine reported kept sets (sampling-mask replay); `None` entries: tokens without one.
        sampling_mask=[r.kept for r in rows] if any(k is not None for r in rows for k in r.kept) else None,
    )


def decode(tokenizer, ids: list[list[int]]) -> list[str]:
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
