"""The async rollout's engine in vLLM server mode: one `/v1/completions` request per turn of each completion."""

from __future__ import annotations

import httpx

from .turns import EngineError, EngineRequestError, EngineTimeoutError, finish_turn, turn_stops, user_stops
from .types import TurnOutput


class CompletionsEngine:
    """Turns from an OpenAI-compatible `/v1/completions` server that takes and returns token ids (vLLM's server, as
    started by `trl vllm-serve` or `vllm serve`).

    Each request carries one sequence as token ids and the sampling settings TRL uses in server mode; the reply's
    token ids are kept whole (a stop inside a token keeps that token, anything after it is cut), with their sampling
    log-probabilities. Connection failures are retried by httpx's transport; what still fails raises `EngineError`.

    A turn may legitimately take long (thousands of tokens on a loaded server), so by default a request has no read
    timeout: only connecting is bounded, and a server that goes away (connection refused, reset or closed) fails the
    request at once. A timeout set with `timeout_s` that expires raises `EngineTimeoutError`.

    Args:
        base_url: The server, e.g. `http://127.0.0.1:8000`.
        tokenizer: The policy tokenizer (to find the code-end tag in a turn).
        code_end: The code-end tag.
        sampling: Request fields for the sampling settings (`temperature`, `top_p`, ...), see `sampling_from_vllm`.
            A `stop` among them is the user's: it ends the completion on every turn.
        model: The served model's name (asked from `/v1/models` when `None`).
        timeout_s: Longest wait for the reply to one request (one turn), or `None` for no limit.
        connect_timeout_s: Longest wait to connect to the server.
        max_connections: Requests in flight at once.
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
    ):
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.code_end = code_end
        self.sampling = dict(sampling or {})
        self.stops = user_stops(self.sampling)
        self.sampling.pop("stop", None)
        self.model = model
        # No pool timeout: the rollout bounds the requests in flight itself, a request waits for a free connection.
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s, pool=None)
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
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout, transport=transport)
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
        except httpx.TimeoutException as exc:
            raise EngineTimeoutError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc
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
        if stops := turn_stops(self.code_end, self.stops, stop_at_code_end):
            payload.update(stop=stops, include_stop_str_in_output=True)
        self.requests += 1
        choice = (await self._request("POST", "/v1/completions", json=payload))["choices"][0]
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        return finish_turn(
            choice["token_ids"], logprobs, self.tokenizer, self.code_end, self.stops, stop_at_code_end, max_tokens
        )


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


def server_engine_from_config(args, tokenizer, vllm_generation, base_url: str) -> CompletionsEngine:
    """The trainer's server-mode engine: TRL's sampling settings, the request timeout of `ReToolConfig`
    (`vllm_request_timeout_s`, none by default: `vllm_server_timeout` is how long to wait for the server to start,
    not for a turn)."""
    return CompletionsEngine(
        base_url,
        tokenizer,
        args.code_end,
        sampling=sampling_from_vllm(vllm_generation),
        timeout_s=args.vllm_request_timeout_s,
        max_connections=args.rollout_concurrency,
    )


__all__ = ["CompletionsEngine", "sampling_from_vllm", "server_engine_from_config"]
