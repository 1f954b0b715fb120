"""Types shared by the rollout and the generation backends (a leaf module, so that neither imports the other)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass
class TurnOutput:
    """What a backend generated for one sequence in one turn.

    `token_ids` stop after the token that completes the code-end tag (when stopping there was requested), after
    an EOS token, or at the budget. `logprobs` are the sampling log-probabilities of those tokens, if the backend
    has them. `finished` is set when the turn ended at one of the user's stop strings (`generation_kwargs["stop"]`):
    the completion ends there, as at EOS. `aborted` is set when the engine gave the turn up (vLLM's `finish_reason`
    "abort"): the turn did not end, and the completion is an engine failure, not the model's. `kept` is, where the
    engine was asked for it (sampling-mask replay), the token ids the truncation kept at each sampled token.
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    finished: bool = False
    aborted: bool = False
    kept: list[list[int]] | None = None


class GenerationBackend(Protocol):
    def generate_turn(
        self, sequences: Sequence[Sequence[int]], max_new_tokens: Sequence[int], stop_at_code_end: Sequence[bool]
    ) -> list[TurnOutput]:
        """Continues each token sequence (prompt + completion so far) for at most `max_new_tokens[i]` tokens."""
        ...


__all__ = ["GenerationBackend", "TurnOutput"]
