"""The async rollout: every completion runs its own generate -> execute -> continue loop.

The barrier loop (`retool_trl.rollout.interleaved_rollout`) waits, at every turn, for the slowest sequence of the batch
and the slowest snippet. Here each completion is a coroutine: it asks the engine for its next turn, runs its own
snippet when the turn ends at the code-end tag, and asks again as soon as that snippet returns, while the others keep
generating. A continuously batching engine (vLLM's server) packs the requests in flight into its batches, so neither
a long turn nor a slow snippet holds anyone else back.

The per-row bookkeeping (token ids in and out, the interpreter mask, log-probs, retries, reward kwargs) is the barrier
loop's own (`_Row.take_turn`, `run_cells`, `interpreter_blocks`, `rollout_result`), so both modes give the same
`RolloutResult` for the same tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Sequence
from typing import Protocol

import httpx

from .parsing import first_stop
from .rollout import (
    RolloutResult,
    RolloutSpec,
    _Row,
    interpreter_blocks,
    release_session,
    reserve_sessions,
    rollout_result,
    run_cells,
)
from .types import TurnOutput


class AsyncTurnEngine(Protocol):
    async def generate(self, token_ids: list[int], max_tokens: int, stop_at_code_end: bool) -> TurnOutput:
        """One turn for one sequence: at most `max_tokens` tokens, stopping after the code-end tag if asked."""
        ...


class EngineError(RuntimeError):
    """The generation engine failed (connection lost, server error): infrastructure, not the model's fault."""


class EngineRequestError(ValueError):
    """The server refused a request as invalid (HTTP 4xx): raised, so that a misconfigured run stops."""


class CompletionsEngine:
    """Turns from an OpenAI-compatible `/v1/completions` server that takes and returns token ids (vLLM's server, as
    started by `trl vllm-serve` or `vllm serve`).

    Each request carries one sequence as token ids and the sampling settings TRL uses in server mode; the reply's
    token ids are kept whole (a stop inside a token keeps that token, anything after it is cut), with their sampling
    log-probabilities. Connection failures are retried by httpx's transport; what still fails raises `EngineError`.

    Args:
        base_url: The server, e.g. `http://127.0.0.1:8000`.
        tokenizer: The policy tokenizer (to find the code-end tag in a turn).
        code_end: The code-end tag.
        sampling: Request fields for the sampling settings (`temperature`, `top_p`, ...), see `sampling_from_vllm`.
        model: The served model's name (asked from `/v1/models` when `None`).
        timeout_s: Timeout of one request.
        max_connections: Requests in flight at once.
    """

    def __init__(
        self,
        base_url: str,
        tokenizer,
        code_end: str,
        sampling: dict | None = None,
        model: str | None = None,
        timeout_s: float = 600.0,
        max_connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.code_end = code_end
        self.sampling = dict(sampling or {})
        self.model = model
        self.timeout_s = timeout_s
        self.max_connections = max_connections
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        self.requests = 0

    async def __aenter__(self) -> CompletionsEngine:
        # Idle connections are dropped before the server's own keep-alive timeout (uvicorn: 5 s) can close them under
        # a request; connection failures are retried by the transport.
        limits = httpx.Limits(
            max_connections=self.max_connections, max_keepalive_connections=self.max_connections, keepalive_expiry=2.0
        )
        transport = self._transport or httpx.AsyncHTTPTransport(retries=3, limits=limits)
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout_s, transport=transport)
        if self.model is None:
            self.model = (await self._request("GET", "/v1/models"))["data"][0]["id"]
        return self

    async def __aexit__(self, *exc) -> None:
        await self._client.aclose()
        self._client = None

    async def _request(self, method: str, path: str, **kwargs) -> dict:
        try:
            try:
                response = await self._client.request(method, path, **kwargs)
            except (httpx.ReadError, httpx.RemoteProtocolError):
                # A kept-alive connection closed by the server as the request went out: once more, on a new one.
                response = await self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise EngineError(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code in (408, 429) or response.status_code >= 500:
            raise EngineError(f"{method} {path}: HTTP {response.status_code}: {response.text[:500]}")
        if response.status_code != 200:
            # The request itself is wrong (context past max_model_len, an unknown field, a wrong model name): a
            # configuration error to fix, not a failure to drop quietly from the loss.
            raise EngineRequestError(f"{method} {path}: HTTP {response.status_code}: {response.text[:500]}")
        try:
            return response.json()
        except ValueError as exc:
            raise EngineError(f"{method} {path}: the reply is not JSON: {exc}") from exc

    def request_fields(self, token_ids: list[int]) -> dict:
        """Extra request fields for one sequence (none here; a subclass can force or steer a sequence)."""
        return {}

    async def generate(self, token_ids: list[int], max_tokens: int, stop_at_code_end: bool) -> TurnOutput:
        payload = {
            "model": self.model,
            "prompt": token_ids,
            "max_tokens": max_tokens,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            **self.sampling,
            **self.request_fields(token_ids),
            "n": 1,
        }
        if stop_at_code_end:
            payload.update(stop=[self.code_end], include_stop_str_in_output=True)
        self.requests += 1
        choice = (await self._request("POST", "/v1/completions", json=payload))["choices"][0]
        ids = list(choice["token_ids"])[:max_tokens]
        if stop_at_code_end and (cut := first_stop(ids, self.tokenizer, self.code_end)) is not None:
            ids = ids[:cut]
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        return TurnOutput(ids, [float(lp) for lp in logprobs[: len(ids)]] if logprobs is not None else None)


def sampling_from_vllm(vllm_generation) -> dict:
    """The request fields of TRL's server-mode sampling settings, read from its `VLLMGeneration` helper."""
    helper = vllm_generation
    sampling = {
        "temperature": helper.temperature,
        "top_p": helper.top_p,
        "top_k": helper.top_k,
        "min_p": 0.0 if helper.min_p is None else helper.min_p,
        "repetition_penalty": helper.repetition_penalty,
    }
    if getattr(helper, "structured_outputs_regex", None):
        sampling["structured_outputs"] = {"regex": helper.structured_outputs_regex}
    sampling.update(helper.generation_kwargs or {})
    return sampling


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
    rows = [_Row(list(ids)) for ids in prompt_ids]
    exec_seconds: list[float] = []
    have_logprobs, engine_calls = [True], [0]
    reserve_sessions(sandbox, len(rows))
    try:
        _run_coroutine(
            _run_all(
                rows, engine, sandbox, tokenizer, spec, max_concurrency, exec_seconds, have_logprobs, engine_calls
            )
        )
    finally:
        for row in rows:
            if row.session is not None:
                row.session.close()
    return rollout_result(rows, tokenizer, spec, exec_seconds, have_logprobs[0], engine_calls[0])


async def _run_all(
    rows, engine, sandbox, tokenizer, spec, max_concurrency, exec_seconds, have_logprobs, engine_calls
) -> None:
    eos = set(spec.eos_token_ids)
    limit = asyncio.Semaphore(max_concurrency)
    # Snippets run in threads (the sandbox API is blocking); one thread per completion in flight at most.
    cells = concurrent.futures.ThreadPoolExecutor(max_workers=min(max_concurrency, 64), thread_name_prefix="retool")
    loop = asyncio.get_running_loop()

    async def complete(row: _Row) -> None:
        async with limit:
            while not row.done:
                budget = spec.max_completion_length - len(row.completion_ids)
                engine_calls[0] += 1  # one request per turn of each completion
                try:
                    out = await engine.generate(
                        row.prompt_ids + row.completion_ids, budget, row.calls < spec.max_tool_calls
                    )
                except EngineError:
                    # The engine failed, not the model: the completion is unscored (`infra_failed`), never -1.
                    row.infra_errors += 1
                    row.infra_failed = row.done = True
                    return
                have_logprobs[0] &= out.logprobs is not None
                text = tokenizer.decode(out.token_ids, skip_special_tokens=False) if out.token_ids else ""
                code = row.take_turn(out, text, spec, eos)
                if code is None:
                    continue
                [result] = await loop.run_in_executor(cells, run_cells, sandbox, [(row, code)])
                [block] = interpreter_blocks(tokenizer, [result.output], spec)
                row.take_result(code, result, block, spec)
                exec_seconds.append(result.duration_s)
            release_session(row)

    try:
        if hasattr(engine, "__aenter__"):
            async with engine:
                await asyncio.gather(*(complete(row) for row in rows))
        else:
            await asyncio.gather(*(complete(row) for row in rows))
    finally:
        cells.shutdown(wait=True)


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
    "async_rollout",
    "sampling_from_vllm",
]
