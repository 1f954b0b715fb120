"""The async rollout's engine in vLLM colocate mode: TRL's own `LLM`, driven request by request.

`LLM.generate` takes a batch and returns when its last sequence is done: a per-turn barrier. Here each turn of each
completion is one request added to the colocated engine (`llm.llm_engine.add_request`); the engine is stepped
(`llm_engine.step`) while any request is in flight, and a finished request resolves its turn at once. The rollout then
runs that completion's snippet (in a worker thread) while the engine keeps decoding the others, and its continuation
joins the running batch as a new request (vLLM's prefix cache serves the earlier turns). No second engine, and no
collective call: each process drives its own engine.

The engine is stepped on the event loop's thread, between the coroutines' turns, so nothing else touches it
concurrently; snippets run in threads meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import uuid

from ..turns import EngineError, EngineRequestError, finish_turn, turn_stops, user_stop_ids, user_stops
from ..types import TurnOutput


class ColocateEngine:
    """Turns from TRL's colocated vLLM engine (`trainer.vllm_generation`, `vllm_mode="colocate"`).

    Sampling settings are TRL's (the `SamplingParams` its helper builds for colocate mode: temperature, top-p/k,
    min-p, repetition penalty, `generation_kwargs`, log-probs as configured); a user's `stop` ends the completion on
    every turn. With sleep mode, the engine is woken once for the rollout and put back to sleep at its end, as the
    barrier backend does. Use it as an async context manager around the rollout (`async_rollout` does).

    Args:
        vllm_generation: TRL's `VLLMGeneration` in colocate mode (its `llm` is the engine).
        tokenizer: The policy tokenizer.
        code_end: The code-end tag.
        replay: With truncated sampling and the importance-sampling correction, how each sampled token's kept set
            is asked for (`training.sampling_mask.ReplaySettings`); `None` asks for none.
    """

    def __init__(self, vllm_generation, tokenizer, code_end: str, replay=None):
        helper = vllm_generation
        if getattr(helper, "tensor_parallel_size", 1) > 1:
            raise ValueError(
                "The async rollout drives one colocated engine per process; with vllm_tensor_parallel_size > 1 the "
                "engine is shared by several processes: set rollout_mode='barrier'."
            )
        self.helper = helper
        self.tokenizer = tokenizer
        self.code_end = code_end
        self.stops = user_stops(helper.generation_kwargs)
        self.stop_ids = user_stop_ids(helper.generation_kwargs)
        self.requests = 0
        self.replay = replay
        self._prefix = f"retool-{uuid.uuid4().hex[:8]}-"
        self._ids = itertools.count()
        self._waiting: dict[str, tuple[asyncio.Future, bool, int]] = {}
        self._added: asyncio.Event | None = None
        self._driver: asyncio.Task | None = None
        self._sleep_paused = False

    # ------------------------------------------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> ColocateEngine:
        self._sleep_paused = wake_for_rollout(self.helper)
        self._added = asyncio.Event()
        self._driver = asyncio.create_task(self._drive(), name="retool-colocate-engine")
        return self

    async def __aexit__(self, *exc) -> None:
        self._driver.cancel()
        try:
            await self._driver
        except (asyncio.CancelledError, Exception):  # cancelled, or its failure was raised by the turns it failed
            pass
        if self._waiting:  # the rollout failed: leave no request of ours in the engine
            for future, _, _ in self._waiting.values():
                future.cancel()
            waiting, self._waiting = list(self._waiting), {}
            with contextlib.suppress(Exception):  # best effort: the failure itself is what gets raised
                self.helper.llm.llm_engine.abort_request(waiting)
        if self._sleep_paused:
            sleep_after_rollout(self.helper)
            self._sleep_paused = False

    async def _drive(self) -> None:
        try:
            engine = self.helper.llm.llm_engine
            while True:
                if not self._waiting:
                    self._added.clear()
                    await self._added.wait()
                for output in engine.step():
                    if output.finished and output.request_id in self._waiting:
                        future, stop, max_tokens = self._waiting.pop(output.request_id)
                        if future.done():
                            continue
                        if output.outputs[0].finish_reason == "abort":  # the engine gave the request up
                            future.set_exception(
                                EngineError("the colocated vLLM engine aborted the request: the turn did not finish")
                            )
                        else:
                            future.set_result((output.outputs[0], stop, max_tokens))
                self._fail_dropped(engine)
                # Let the completions whose turn ended take it, run their snippets and add their next requests.
                await asyncio.sleep(0)
        except Exception as exc:  # the engine itself failed: every turn in flight fails with it, loudly
            for future, _, _ in self._waiting.values():
                if not future.done():
                    future.set_exception(exc)
            raise  # its requests are aborted on the way out (`__aexit__`)

    def _fail_dropped(self, engine) -> None:
        """Liveness: requests still awaited while the engine has none left were dropped by it (they will never finish);
        their turns fail now instead of waiting forever. Requests are added on this thread, between steps, so an
        engine without unfinished requests after a step has none of ours."""
        if self._waiting and not engine.has_unfinished_requests():
            dropped, self._waiting = self._waiting, {}
            for future, _, _ in dropped.values():
                if not future.done():
                    future.set_exception(
                        EngineError(
                            "the colocated vLLM engine has no unfinished request left but "
                            f"{len(dropped)} turn(s) were still waiting: the engine dropped them"
                        )
                    )

    # ------------------------------------------------------------------------------------------------------ turns
    def sampling_params(self, max_tokens: int, stop_at_code_end: bool):
        """TRL's colocate-mode `SamplingParams` for one turn (final output only, the turn's stop strings)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        helper = self.helper
        kwargs = {
            "n": 1,
            "repetition_penalty": helper.repetition_penalty,
            "temperature": helper.temperature,
            "top_p": helper.top_p,
            "top_k": helper.top_k,
            "min_p": 0.0 if helper.min_p is None else helper.min_p,
            "max_tokens": max_tokens,
            "logprobs": helper.logprobs,
            **(helper.generation_kwargs or {}),
        }
        if getattr(helper, "structured_outputs_regex", None) is not None:
            kwargs["structured_outputs"] = StructuredOutputsParams(regex=helper.structured_outputs_regex)
        elif isinstance(kwargs.get("structured_outputs"), dict):
            kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
        kwargs.pop("stop", None)
        if self.replay is not None:
            # vLLM's mask needs a top_k to size its buffers (the vocabulary where the user set none: keeps every
            # token, the same sampling); the log-probs source reads the kept set from the top_k log-probs.
            kwargs["top_k"] = self.replay.top_k
            kwargs["logprobs"] = max(kwargs["logprobs"] or 0, self.replay.num_logprobs)
        if stops := turn_stops(self.code_end, self.stops, stop_at_code_end):
            kwargs.update(stop=stops, include_stop_str_in_output=True)
        params = SamplingParams(**kwargs)
        params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, when it finishes
        return params

    async def generate(self, token_ids: list[int], max_tokens: int, stop_at_code_end: bool) -> TurnOutput:
        if self._driver.done():  # the engine failed under another turn: so does this one
            self._driver.result()
        request_id = f"{self._prefix}{next(self._ids)}"
        future = asyncio.get_running_loop().create_future()
        # Added from the loop's thread while the engine is between steps (the driver steps it on this thread).
        try:
            params = self.sampling_params(max_tokens, stop_at_code_end)
            self.helper.llm.llm_engine.add_request(request_id, {"prompt_token_ids": list(token_ids)}, params)
        except ValueError as exc:  # vLLM's input checks (a context past max_model_len, a bad sampling setting)
            raise EngineRequestError(
                f"the colocated vLLM engine refused a request of {len(token_ids)} prompt tokens and max_tokens "
                f"{max_tokens}: {' '.join(str(exc).split())[:500]}"
            ) from exc
        self._waiting[request_id] = (future, stop_at_code_end, max_tokens)
        self.requests += 1
        self._added.set()
        completion, stop, budget = await future
        logprobs, steps = None, completion.logprobs
        if steps is not None:  # the sampled token's log-prob at each step (a count mismatch is refused below)
            tokens = completion.token_ids
            logprobs = (
                [s[t].logprob for t, s in zip(tokens, steps)] if len(steps) == len(tokens) else [0.0] * len(steps)
            )
        kept = None
        if self.replay is not None:
            kept = kept_sets(completion, self.replay.source)
            if kept is None:  # a run that asked for the replay stops rather than train on a biased correction
                raise RuntimeError(
                    f"the colocated vLLM engine returned no kept sets ({self.replay.source}) for a turn sampled with "
                    "truncation: the importance-sampling correction cannot be replayed"
                )
        return finish_turn(
            completion.token_ids,
            logprobs,
            self.tokenizer,
            self.code_end,
            self.stops,
            stop,
            budget,
            self.stop_ids,
            kept=kept,
        )


def kept_sets(completion, source: str) -> list[list[int]] | None:
    """Each generated token's kept set from one vLLM `CompletionOutput`; `None` when the engine returned none.

    `source="engine"`: vLLM's own sampling mask (`CompletionOutput.sampling_mask.token_ids`, one list of kept ids per
    token). `source="logprobs"`: the tokens of the returned processed log-probs that are finite (vLLM gives the tokens
    the truncation removed `-inf`); exact when the engine was asked for at least as many log-probs as tokens kept.
    """
    if source == "engine":
        mask = getattr(completion, "sampling_mask", None)
        return None if mask is None else [list(ids) for ids in mask.token_ids]
    steps = completion.logprobs
    if steps is None:
        return None
    return [[t for t, lp in step.items() if math.isfinite(lp.logprob)] for step in steps]


def wake_for_rollout(helper) -> bool:
    """With sleep mode, wakes TRL's colocated engine for a whole rollout; returns whether it must sleep again.

    TRL's helper sleeps (and later re-syncs all weights) after every `generate` call; a rollout makes many turns, so
    the engine is woken once (weights re-pushed if they were discarded) and put back to sleep by
    `sleep_after_rollout`.
    """
    if getattr(helper, "mode", None) != "colocate" or not getattr(helper, "enable_sleep_mode", False):
        return False
    if helper._llm_weights_sleeping:
        helper.sync_weights()
    helper.llm.wake_up(tags=["kv_cache"])
    helper.enable_sleep_mode = False
    return True


def sleep_after_rollout(helper) -> None:
    """Puts the engine woken by `wake_for_rollout` back to sleep (level 2, as TRL does) and restores sleep mode."""
    helper.llm.sleep(level=2)
    helper._llm_weights_sleeping, helper.enable_sleep_mode = True, True


__all__ = ["ColocateEngine", "kept_sets", "sleep_after_rollout", "wake_for_rollout"]
