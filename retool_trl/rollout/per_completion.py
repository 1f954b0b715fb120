"""The async rollout: every completion runs its own generate -> execute -> continue loop.

The barrier loop (`retool_trl.rollout.interleaved_rollout`) waits, at every turn, for the slowest sequence of the batch
and the slowest snippet. Here each completion is a coroutine: it asks the engine for its next turn, runs its own
snippet when the turn ends at the code-end tag, and asks again as soon as that snippet returns, while the others keep
generating. A continuously batching engine packs the requests in flight into its batches, so neither a long turn nor
a slow snippet holds anyone else back. Two engines (`engines/`): vLLM's server (`vllm_server.CompletionsEngine`:
the turns ready at once go in one streamed HTTP request) and the colocated engine of TRL's own `LLM`, driven request
by request (`vllm_colocate.ColocateEngine`).

The per-row bookkeeping (token ids in and out, the interpreter mask, log-probs, reward kwargs: `rows`) and the
sandbox calls with their retries (`cells`) are the ones the barrier loop uses, so both modes give the same
`RolloutResult` for the same tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
from collections.abc import Sequence
from typing import Protocol

from .cells import close_sessions, prepare_next_rollout, release_session, reserve_sessions, run_calls
from .engines.vllm_server import CompletionsEngine, sampling_from_vllm
from .rows import Row, result_blocks, rollout_result
from .spec import RolloutResult, RolloutSpec
from .turns import EngineError, EngineRequestError, EngineTimeoutError
from .types import TurnOutput


class AsyncTurnEngine(Protocol):
    async def generate(self, token_ids: list[int], max_tokens: int, stop_at_code_end: bool) -> TurnOutput:
        """One turn for one sequence: at most `max_tokens` tokens, stopping after the code-end tag if asked."""
        ...


def async_rollout(
    prompt_ids: Sequence[Sequence[int]],
    engine: AsyncTurnEngine,
    sandbox,
    tokenizer,
    spec: RolloutSpec,
    max_concurrency: int = 256,
) -> RolloutResult:
    """Generates one completion per prompt, each in its own loop (see the module docstring).

    Args:
        prompt_ids: Token ids of each prompt (already repeated per generation).
        engine: Generates one turn of one sequence (`CompletionsEngine`, or a test double); used as an async context
            manager if it is one.
        sandbox: A `retool_trl.sandbox` backend; its calls for different sessions run in worker threads at once.
        tokenizer: Decodes turns (to find code) and encodes interpreter blocks.
        spec: Limits and tags.
        max_concurrency: Completions in flight at once.
    """
    rows = [Row(list(ids)) for ids in prompt_ids]
    exec_seconds: list[float] = []
    have_logprobs, engine_calls = [True], [0]
    requests_before = getattr(engine, "requests", None)
    reserve_sessions(sandbox, len(rows), spec)
    try:
        with short_gil_slices():
            _run_coroutine(
                _run_all(
                    rows, engine, sandbox, tokenizer, spec, max_concurrency, exec_seconds, have_logprobs, engine_calls
                )
            )
    finally:
        close_sessions(rows)
    prepare_next_rollout(sandbox, len(rows), spec)
    if requests_before is not None:  # engines that count their requests (several turns may share one)
        engine_calls[0] = engine.requests - requests_before
    return rollout_result(rows, tokenizer, spec, exec_seconds, have_logprobs[0], engine_calls[0])


async def _run_all(
    rows, engine, sandbox, tokenizer, spec, max_concurrency, exec_seconds, have_logprobs, engine_calls
) -> None:
    eos = set(spec.eos_token_ids)
    limit = asyncio.Semaphore(max_concurrency)
    # Snippets run in threads (the sandbox API is blocking); one thread per completion in flight at most.
    cells = concurrent.futures.ThreadPoolExecutor(max_workers=min(max_concurrency, 64), thread_name_prefix="retool")
    loop = asyncio.get_running_loop()

    async def complete(row: Row) -> None:
        async with limit:
            row.done = row.done or row.budget(spec) <= 0  # a prompt that fills the context: nothing to generate
            while not row.done:
                budget = row.budget(spec)
                engine_calls[0] += 1  # one turn of one completion
                try:
                    out = await engine.generate(
                        row.prompt_ids + row.completion_ids, budget, row.calls < spec.max_tool_calls
                    )
                except EngineError as exc:
                    # The engine failed, not the model: the completion is unscored (`infra_failed`), never -1.
                    row.infra_errors += 1
                    row.engine_timeouts += isinstance(exc, EngineTimeoutError)
                    row.infra_failed = row.done = True
                    return
                have_logprobs[0] &= out.logprobs is not None
                text = tokenizer.decode(out.token_ids, skip_special_tokens=False) if out.token_ids else ""
                calls = row.take_turn(out, text, spec, eos)
                if not calls:
                    continue
                [results] = await loop.run_in_executor(cells, run_calls, sandbox, [(row, calls)])
                [block] = result_blocks(tokenizer, [results], spec)
                row.take_result(calls, results, block, spec)
                exec_seconds.extend(r.duration_s for r, c in zip(results, calls, strict=True) if c.code is not None)
            release_session(row)

    try:
        if hasattr(engine, "__aenter__"):
            async with engine:
                await asyncio.gather(*(complete(row) for row in rows))
        else:
            await asyncio.gather(*(complete(row) for row in rows))
    finally:
        cells.shutdown(wait=True)


GIL_SLICE_S = 0.0002
_slices_lock = threading.Lock()
_slices_depth = [0, None]  # rollouts in progress, and the switch interval to restore after the last one


@contextlib.contextmanager
def short_gil_slices():
    """Shortens the interpreter's GIL switch interval (5 ms by default) while an async rollout runs.

    The loop's thread is busy most of the time (stepping the colocated engine, whose output processing is Python, or
    parsing a stream), and every snippet's thread needs the GIL back after each of the few dozen system calls of a
    sandbox call: with 5 ms slices, each of those waits up to a slice behind the busy thread. Measured with 32 threads
    of sleeping cells beside one busy Python thread: 420 ms of overhead per call (p50) at 5 ms slices, 103 ms at
    0.2 ms (68 ms with no busy thread). Restored when the last rollout in progress ends."""
    with _slices_lock:
        if _slices_depth[0] == 0:
            _slices_depth[1] = sys.getswitchinterval()
            sys.setswitchinterval(min(_slices_depth[1], GIL_SLICE_S))
        _slices_depth[0] += 1
    try:
        yield
    finally:
        with _slices_lock:
            _slices_depth[0] -= 1
            if _slices_depth[0] == 0:
                sys.setswitchinterval(_slices_depth[1])


def _run_coroutine(coroutine) -> None:
    """Runs `coroutine` to completion from synchronous code, also where an event loop is already running (a
    notebook): then in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(coroutine)
        return
    error: list[BaseException] = []

    def target():
        try:
            asyncio.run(coroutine)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, name="retool-async-rollout")
    thread.start()
    thread.join()
    if error:
        raise error[0]


__all__ = [
    "AsyncTurnEngine",
    "CompletionsEngine",
    "EngineError",
    "EngineRequestError",
    "EngineTimeoutError",
    "async_rollout",
    "sampling_from_vllm",
]
