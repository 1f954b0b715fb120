"""The async rollout's engine in vLLM server mode: `/v1/completions` requests that carry every turn ready at once.

Each HTTP request costs the server (parsing, validation, scheduling) and the client (a connection, JSON) the same
whatever it carries, so one request per turn of each completion spends much of what the async rollout gains. Here the
turns that become ready at the same moment go to the server together, as one request with a list of token-id prompts,
and each sequence's turn is taken as soon as it finishes, from the streamed reply (vLLM streams every prompt's choice
with its own `index`). At most one request is being opened at a time: the turns that become ready meanwhile go in the
next one, so the batches grow with the per-request cost instead of waiting on a timer.

This module decides which turns share a request and assembles each turn from its choices; the HTTP itself
(connections, retries, what a failed request means, reading a streamed reply) is `completions_http`'s.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field

import httpx

from ...format.registry import format_of
from ..turns import EngineError, EngineTimeoutError, finish_turn, fitting_parts, turn_stops, user_stop_ids, user_stops
from ..types import TurnOutput
from .completions_http import CompletionsClient, read_choices

# Streamed chunks per sequence: the first token and the finished turn (vLLM sends both at once whatever the interval;
# servers without `stream_interval` ignore the field and stream every token, which is read the same way).
STREAM_INTERVAL = 1 << 20


@dataclass
class _Turn:
    """One sequence's turn, waiting for its request to be sent and its choice to finish."""

    prompt: list[int]
    max_tokens: int
    stop_at_code_end: bool
    fields: dict
    future: asyncio.Future
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    kept: list[list[int]] | None = field(default_factory=list)  # from the top log-probs (sampling-mask replay)

    def group(self) -> tuple:
        """Turns of one request share their sampling fields and stop strings; their token budgets differ (one per
        request: the largest, each turn cut to its own), but by less than a factor of 2, so that a turn that runs to
        its budget decodes at most as many tokens again for nothing."""
        return (
            self.stop_at_code_end,
            json.dumps(self.fields, sort_keys=True, default=str),
            self.max_tokens.bit_length(),
        )


class CompletionsEngine:
    """Turns from an OpenAI-compatible `/v1/completions` server that takes and returns token ids (vLLM's server, as
    started by `trl vllm-serve` or `vllm serve`).

    Each request carries the sequences whose turns are ready (see the module docstring) as token ids, and the sampling
    settings TRL uses in server mode; a turn's token ids are kept whole (a stop inside a token keeps that token,
    anything after it is cut), with their sampling log-probabilities. A request that fails (`CompletionsClient`: the
    connections, their retries, and what each failure means) fails every turn of it not yet finished. A turn not
    finished `timeout_s` after it was asked for raises `EngineTimeoutError`.

    Args:
        base_url: The server, e.g. `http://127.0.0.1:8000`.
        tokenizer: The policy tokenizer (to find the code-end tag in a turn).
        code_end: The code-end tag.
        sampling: Request fields for the sampling settings (`temperature`, `top_p`, ...), see `sampling_from_vllm`.
            A `stop` among them is the user's: it ends the completion on every turn.
        model: The served model's name (asked from `/v1/models` when `None`).
        timeout_s: Longest wait for one turn, or `None` for no limit.
        connect_timeout_s: Longest wait to connect to the server.
        max_connections: Requests in flight at once (the rollout bounds the sequences in flight itself).
        coalesce: Send the turns ready at once in one streamed request; `False` sends one plain request per turn.
        max_model_len: The server's context limit (prompt + generated tokens), read from `/v1/models` when the model
            name is asked from there. A request's `max_tokens` is one for all its prompts, and vLLM refuses the whole
            request (HTTP 400) when any prompt plus that budget passes the limit: turns that would not fit beside the
            others go in a request of their own.
        replay: With truncated sampling and the importance-sampling correction, the kept set of each sampled token
            is read from the server's processed log-probs of the top `replay.top_k` tokens (`kept_from_top_logprobs`;
            vLLM's server does not return its sampling mask); `None` asks for none.
    """

    def __init__(
        self,
        base_url: str,
        tokenizer,
        code_end: str,
        sampling: dict | None = None,
        model: str | None = None,
        timeout_s: float | None = None,
        connect_timeout_s: float = 30.0,
        max_connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
        coalesce: bool = True,
        max_model_len: int | None = None,
        replay=None,
    ):
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.code_end = code_end
        self.sampling = dict(sampling or {})
        self.stops = user_stops(self.sampling)
        self.sampling.pop("stop", None)
        self.stop_ids = user_stop_ids(self.sampling)
        self.replay = replay
        self.num_logprobs = 0  # the sampled token's log-prob only
        if replay is not None:  # the top_k (the vocabulary without one: every token kept) and as many log-probs
            self.sampling["top_k"] = replay.top_k
            self.num_logprobs = replay.num_logprobs
        self.max_model_len = max_model_len
        self.model = model
        self.timeout_s = timeout_s
        self.coalesce = coalesce
        self._http = CompletionsClient(base_url, timeout_s, connect_timeout_s, max_connections, transport)
        self.requests = 0  # HTTP requests for turns
        self._ready: list[_Turn] = []
        self._sender: asyncio.Task | None = None
        self._streams: set[asyncio.Task] = set()

    async def __aenter__(self) -> CompletionsEngine:
        self._http.open()
        if self.model is None:
            card = (await self._http.request("GET", "/v1/models"))["data"][0]
            self.model = card["id"]
            self.max_model_len = self.max_model_len or card.get("max_model_len")  # vLLM's model card has it
        return self

    async def __aexit__(self, *exc) -> None:
        for task in [self._sender, *self._streams]:  # left running only if the rollout failed
            if task is not None and not task.done():
                task.cancel()
        await asyncio.gather(*self._streams, return_exceptions=True)
        await self._http.close()

    def request_fields(self, token_ids: list[int]) -> dict:
        """Extra request fields for one sequence (none here; a subclass can force or steer a sequence)."""
        return {}

    async def generate(self, token_ids: list[int], max_tokens: int, stop_at_code_end: bool) -> TurnOutput:
        if not self.coalesce:
            return await self._generate_alone(token_ids, max_tokens, stop_at_code_end)
        turn = _Turn(
            list(token_ids),
            max_tokens,
            stop_at_code_end,
            self.request_fields(token_ids),
            asyncio.get_running_loop().create_future(),
        )
        self._ready.append(turn)
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_ready())
        try:
            # On timeout the future is cancelled: its stream stops waiting for it (and is closed once nobody waits).
            token_ids, logprobs, kept = await asyncio.wait_for(turn.future, self.timeout_s)
        except asyncio.TimeoutError as exc:  # not the builtin TimeoutError before Python 3.11
            raise EngineTimeoutError(f"the turn took longer than {self.timeout_s} s") from exc
        return self._finish(token_ids, logprobs, kept, stop_at_code_end, max_tokens)

    def _finish(self, token_ids, logprobs, kept, stop_at_code_end: bool, max_tokens: int) -> TurnOutput:
        if self.replay is not None and kept is None:  # a run that asked for the replay stops rather than train biased
            raise RuntimeError(
                "the vLLM server returned no top log-probs for a turn sampled with truncation: the importance-"
                "sampling correction cannot be replayed (is it started with `--max-logprobs -1`, as `trl vllm-serve` "
                "does?)"
            )
        return finish_turn(
            token_ids,
            logprobs,
            self.tokenizer,
            self.code_end,
            self.stops,
            stop_at_code_end,
            max_tokens,
            self.stop_ids,
            kept=kept if self.replay is not None else None,
        )

    async def _send_ready(self) -> None:
        """Sends the ready turns, grouped by sampling settings, one request per group; then waits until the server
        has taken those requests (the reply's headers) before sending the turns that became ready meanwhile."""
        while self._ready:
            ready, self._ready = self._ready, []
            groups: dict[tuple, list[_Turn]] = defaultdict(list)
            for turn in ready:
                groups[turn.group()].append(turn)
            opened = []
            for turns in (part for group in groups.values() for part in self._fitting(group)):
                opened.append(asyncio.get_running_loop().create_future())
                task = asyncio.create_task(self._stream(turns, opened[-1]))
                self._streams.add(task)
                task.add_done_callback(self._streams.discard)
            await asyncio.wait(opened)

    def _fitting(self, turns: list[_Turn]) -> list[list[_Turn]]:
        """`turns` split into requests whose one `max_tokens` (their largest budget) fits every prompt's context
        (`fitting_parts`)."""
        parts = fitting_parts([len(t.prompt) for t in turns], [t.max_tokens for t in turns], self.max_model_len)
        return [[turns[i] for i in part] for part in parts]

    async def _stream(self, turns: list[_Turn], opened: asyncio.Future) -> None:
        """One streamed request for `turns`; each turn's future resolves when its choice finishes."""
        first = turns[0]
        prompts = [turn.prompt for turn in turns]
        payload = {
            "model": self.model,
            "prompt": prompts if len(prompts) > 1 else prompts[0],
            "max_tokens": max(turn.max_tokens for turn in turns),
            "logprobs": self.num_logprobs,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            **self.sampling,
            **first.fields,
            "n": 1,
            "stream": True,
            "stream_interval": STREAM_INTERVAL,
        }
        if stops := turn_stops(self.code_end, self.stops, first.stop_at_code_end):
            payload.update(stop=stops, include_stop_str_in_output=True)
        self.requests += 1
        try:
            async with self._http.stream("POST", "/v1/completions", payload) as response:
                if not opened.done():
                    opened.set_result(None)
                await read_choices(
                    response,
                    lambda choice, final: _take(turns, choice, final),
                    lambda: all(turn.future.done() for turn in turns),
                )
        except Exception as exc:  # noqa: BLE001 - handed to every turn still waiting (they raise it)
            for turn in turns:
                if not turn.future.done():
                    turn.future.set_exception(exc)
        finally:
            if not opened.done():
                opened.set_result(None)
        for turn in turns:
            if not turn.future.done():
                turn.future.set_exception(EngineError("the server's reply ended before this sequence's turn did"))

    async def _generate_alone(self, token_ids: list[int], max_tokens: int, stop_at_code_end: bool) -> TurnOutput:
        """One plain (not streamed) request for one turn."""
        payload = {
            "model": self.model,
            "prompt": token_ids,
            "max_tokens": max_tokens,
            "logprobs": self.num_logprobs,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            **self.sampling,
            **self.request_fields(token_ids),
            "n": 1,
        }
        if stops := turn_stops(self.code_end, self.stops, stop_at_code_end):
            payload.update(stop=stops, include_stop_str_in_output=True)
        self.requests += 1
        choice = (await self._http.request("POST", "/v1/completions", json=payload))["choices"][0]
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if choice.get("finish_reason") == "abort":
            raise EngineError("the server aborted the request (finish_reason 'abort'): the turn did not finish")
        tops = (choice.get("logprobs") or {}).get("top_logprobs")
        kept = kept_from_top_logprobs(tops) if tops is not None else None
        return self._finish(choice["token_ids"], logprobs, kept, stop_at_code_end, max_tokens)


def _take(turns: list[_Turn], choice: dict, final: bool = False) -> None:
    """Adds a streamed choice's tokens and log-probs to its turn (`index`: the prompt's place in the request); a
    choice with a `finish_reason` (or from a reply that is not streamed: `final`) finishes the turn."""
    try:
        turn = turns[int(choice.get("index", 0))]
    except (IndexError, ValueError) as exc:
        raise EngineError(f"a choice for no prompt of the request: index {choice.get('index')!r}") from exc
    ids = choice.get("token_ids") or []
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    turn.token_ids.extend(ids)
    if turn.logprobs is not None and (logprobs is not None or not ids):
        turn.logprobs.extend(logprobs or [])
    else:
        turn.logprobs = None  # tokens without log-probs: none for the turn
    tops = (choice.get("logprobs") or {}).get("top_logprobs")
    if turn.kept is not None and (tops is not None or not ids):
        turn.kept.extend(kept_from_top_logprobs(tops or []))
    else:
        turn.kept = None
    reason = choice.get("finish_reason")
    if reason == "abort" and not turn.future.done():
        # vLLM aborts a request it cannot finish (engine failure, a reset under it): the turn did not end.
        turn.future.set_exception(EngineError("the server aborted this sequence's request (finish_reason 'abort')"))
    elif (final or reason is not None) and not turn.future.done():
        turn.future.set_result((turn.token_ids, turn.logprobs, turn.kept))


def kept_from_top_logprobs(tops: list[dict | None]) -> list[list[int]]:
    """Each token's kept set from a `/v1/completions` reply's `top_logprobs` (keys `token_id:ID`, as asked with
    `return_tokens_as_token_ids`): the tokens whose processed log-prob is finite. vLLM's server writes the `-inf` of
    a token the truncation removed as -9999.0 (JSON has no infinity)."""
    return [
        [int(key.rsplit(":", 1)[1]) for key, value in (top or {}).items() if value is not None and value > -9999.0]
        for top in tops
    ]


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


def server_engine_from_config(
    args, tokenizer, vllm_generation, base_url: str, max_model_len: int | None = None, replay=None
) -> CompletionsEngine:
    """The trainer's server-mode engine: TRL's sampling settings, the request timeout of `ReToolConfig`
    (`vllm_request_timeout_s`, none by default: `vllm_server_timeout` is how long to wait for the server to start,
    not for a turn)."""
    return CompletionsEngine(
        base_url,
        tokenizer,
        format_of(args).stop_for(args),
        sampling=sampling_from_vllm(vllm_generation),
        timeout_s=args.vllm_request_timeout_s,
        max_connections=args.rollout_concurrency,
        max_model_len=max_model_len,
        replay=replay,
    )


def async_applies(vllm_generation) -> bool:
    """Whether the async rollout can drive this vLLM setup: the server, or a colocated engine of this process alone
    (with tensor parallelism the engine is shared by several processes, whose calls are collective: barrier)."""
    mode = getattr(vllm_generation, "mode", None)
    return mode == "server" or (mode == "colocate" and getattr(vllm_generation, "tensor_parallel_size", 1) == 1)


def server_url(args) -> str:
    """The URL of the vLLM server a `ReToolConfig` names (`vllm_server_base_url`, or host and port)."""
    if args.vllm_server_base_url:
        return args.vllm_server_base_url
    host = args.vllm_server_host
    if host in ("0.0.0.0", "::", ""):
        # A server listening on every interface, where TRL's main process reaches it (its own host): the launcher's
        # MASTER_ADDR, so that processes on other nodes reach it too; this host when run without a launcher.
        host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    if ":" in host and not host.startswith("["):  # an IPv6 address goes in brackets in a URL
        host = f"[{host}]"
    return f"http://{host}:{args.vllm_server_port}"


def served_max_model_len(url: str) -> int | None | str:
    """The `max_model_len` of the first model on a vLLM server's `/v1/models` (`url`), `None` when its card has
    none, or the problem (a string) when the server did not answer with a card."""
    try:
        reply = httpx.get(url, timeout=30.0)
        reply.raise_for_status()
        limit = reply.json()["data"][0].get("max_model_len")
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return int(limit) if limit else None


__all__ = [
    "CompletionsEngine",
    "async_applies",
    "kept_from_top_logprobs",
    "sampling_from_vllm",
    "served_max_model_len",
    "server_engine_from_config",
    "server_url",
]
