"""What a rollout is given and what it gives back: its limits and call format (`RolloutSpec`), and its token-level
result per completion (`RolloutResult`, with the reward kwargs named in `ROLLOUT_FIELDS`).

Both loops (`batched`, `per_completion`), the trainer, evaluation and the metrics read these, so they live apart from
either loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..format.parsing import Tags
from ..format.tags import TagFormat

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
    # Each token's kept set where the engine reported them (sampling-mask replay, `training.sampling_mask`): the ids
    # the truncation kept when it was sampled, `None` for tokens the interpreter inserted. `None` otherwise.
    sampling_mask: list[list[list[int] | None]] | None = None

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
