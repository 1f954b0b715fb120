"""What every vLLM turn engine does with a turn: the stop strings it asks for, and how it cuts and checks the reply.

Shared by the barrier backend (`engines.vllm_batched`) and the async engines (`engines.vllm_server`,
`engines.vllm_colocate`), so that all of them end a turn at the same token for the same reply.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..format.parsing import first_stop
from .types import TurnOutput


class EngineError(RuntimeError):
    """The generation engine failed (connection lost, server error, a malformed reply): infrastructure, not the
    model's fault."""


class EngineTimeoutError(EngineError):
    """A turn took longer than the request timeout the user set (`ReToolConfig.vllm_request_timeout_s`)."""


class EngineRequestError(ValueError):
    """The server refused a request as invalid (HTTP 4xx): raised, so that a misconfigured run stops."""


def user_stops(generation_kwargs: dict | None) -> list[str]:
    """The stop strings the user asked for in `generation_kwargs["stop"]` (a string or a list)."""
    stop = (generation_kwargs or {}).get("stop") or []
    return [stop] if isinstance(stop, str) else list(stop)


def user_stop_ids(generation_kwargs: dict | None) -> frozenset[int]:
    """The stop token ids the user asked for in `generation_kwargs["stop_token_ids"]`: like EOS, they end the
    completion (vLLM stops the turn there; the rollout must not ask for another)."""
    return frozenset(int(i) for i in (generation_kwargs or {}).get("stop_token_ids") or [])


def turn_stops(code_end: str | None, stops: Sequence[str], stop_at_code_end: bool) -> list[str]:
    """The stop strings of one turn: the user's on every turn (they end the completion, as in TRL), and the call
    format's stop (the code-end tag) while the completion may still call code; `None` where the call format has no
    stop string (a turn's own end closes its calls)."""
    return [*stops, code_end] if stop_at_code_end and code_end else list(stops)


def finish_turn(
    token_ids: Sequence[int],
    logprobs: Sequence[float] | None,
    tokenizer,
    code_end: str | None,
    stops: Sequence[str],
    stop_at_code_end: bool,
    max_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
    kept: Sequence[Sequence[int]] | None = None,
) -> TurnOutput:
    """The turn as the rollout takes it, from an engine's reply (asked with `turn_stops(...)` and the stop strings
    kept in the output).

    Whole tokens are kept: the turn ends at the token completing the first stop string, anything after it is cut. A
    user's stop string ends the completion (`TurnOutput.finished`); the code-end tag ends only the turn.

    Raises:
        EngineError: The engine returned a different number of log-probs (or kept sets) than tokens (they could not
            be aligned), or a kept set without its sampled token (an empty one included).
    """
    ids = list(token_ids)
    if kept is not None and len(kept) != len(ids):
        raise EngineError(
            f"the engine returned {len(kept)} sampling masks for {len(ids)} tokens: the kept sets cannot be aligned "
            "with the tokens"
        )
    for t, (token, kept_t) in enumerate(zip(ids, kept or (), strict=False)):
        if token not in kept_t:  # an empty set too: the replay would read its mass as 1, silently biased
            raise EngineError(
                f"the engine's kept set at token {t} does not hold the sampled token {token} "
                f"({len(kept_t)} tokens kept): the importance-sampling correction cannot be replayed"
            )
    if logprobs is not None and len(logprobs) != len(ids):
        raise EngineError(
            f"the engine returned {len(logprobs)} log-probs for {len(ids)} tokens: the sampling log-probs cannot be "
            "aligned with the tokens (is the server a vLLM server started with TRL's settings?)"
        )
    ids = ids[:max_tokens]
    end, finished = None, False
    if stop_at_code_end and code_end:
        end = first_stop(ids, tokenizer, code_end)
    for stop in stops:  # a stop string completed at or before the code-end tag's token ends the completion
        cut = first_stop(ids if end is None else ids[:end], tokenizer, stop)
        if cut is not None:
            end, finished = cut, True
    if end is not None:
        ids = ids[:end]
    for k, token in enumerate(ids):  # a stop token id (kept, as vLLM returns it) ends the completion
        if token in stop_ids:
            ids, finished = ids[: k + 1], True
            break
    kept_lps = [_logprob(lp) for lp in logprobs[: len(ids)]] if logprobs is not None else None
    return TurnOutput(ids, kept_lps, finished, kept=None if kept is None else [list(k) for k in kept[: len(ids)]])


def fitting_parts(lengths: Sequence[int], budgets: Sequence[int], limit: int | None) -> list[list[int]]:
    """Indices of turns (`lengths[i]` prompt tokens, `budgets[i]` tokens to generate) split into requests whose one
    `max_tokens`, the largest budget of the request, fits every prompt of it (vLLM checks prompt + `max_tokens` <=
    `max_model_len` for each prompt and refuses the whole request otherwise).

    The largest budget left sets a request's `max_tokens`, and every turn whose context has room for it goes beside
    it (it decodes past its own budget and is cut there): with a limit sized as TRL advises (longest prompt +
    completion), a turn's own budget always fits its context, so most turns fit beside the first and a batch needs a
    few requests, not one per distinct budget. A turn that fits nowhere is sent alone: the server says why.
    """
    left = sorted(range(len(lengths)), key=lambda i: -budgets[i])
    if not limit:
        return [sorted(left)] if left else []
    parts = []
    while left:
        budget = budgets[left[0]]
        part = [i for i in left if lengths[i] + budget <= limit]
        if left[0] not in part:  # its own budget passes its context: alone
            part = [left[0]]
        parts.append(sorted(part))
        taken = set(part)
        left = [i for i in left if i not in taken]
    return parts


def _logprob(value) -> float:
    # TRL's client turns a NaN log-prob into `None` (JSON has no NaN); its trainer reads `None` as NaN and keeps such
    # tokens out of the importance-sampling correction. The same here: NaN, never an exception mid-rollout.
    return float("nan") if value is None else float(value)


__all__ = [
    "EngineError",
    "EngineRequestError",
    "EngineTimeoutError",
    "finish_turn",
    "fitting_parts",
    "turn_stops",
    "user_stop_ids",
    "user_stops",
]
