"""Server mode: the turns ready at once go to the server in one streamed request, each taken as soon as it finishes.

The fake server below speaks what vLLM 0.32's OpenAI server returns (measured on its CPU build, quickstart model):
for `/v1/completions` with a list of token-id prompts, `stream: true`, `logprobs: 0`, `return_token_ids: true`, it
streams SSE `data:` chunks, one choice per chunk, whose `index` is the prompt's place in the list; each chunk carries
that choice's new `token_ids` and `logprobs.token_logprobs` (the concatenation equals the unstreamed reply's), the
first one also the `prompt_token_ids`; the last chunk of a choice has its `finish_reason`; choices of different
prompts interleave as their sequences progress; `data: [DONE]` ends the reply. With `stream_interval` larger than a
turn, a choice comes in two chunks: its first token and the rest. A failure while generating is a chunk with an
`error` object, then `[DONE]`.
"""

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from helpers.scripted_turns import EOS, TOKENIZER, Script, ids_of
from helpers.testing_utils import reply_json
from retool_trl.rollout import RolloutSpec
from retool_trl.rollout.per_completion import CompletionsEngine, EngineRequestError, async_rollout
from retool_trl.testing import FakeSandbox

SPEC = RolloutSpec(max_completion_length=300, eos_token_ids=[EOS], max_tool_calls=3)
TEXTS = [
    "<code>print(1)</code>a<code>print(2)</code>\\boxed{3}",
    "hmm " * 20 + "<code>print(5)</code>\\boxed{5}",
    "\\boxed{7}",
    "<code>x = 4</code>then<code>print(x)</code>and<code>print(x * 2)</code>\\boxed{8}",
    "so<code>1/0</code>" + "long " * 15 + "\\boxed{0}",
]


class StreamingServer:
    """vLLM's streamed completions on 127.0.0.1 (see the module docstring), decoding every prompt of a request one
    token per `step_s` at once (continuous batching). `scripts` maps a prompt (tuple of ids) to its `Script`.

    Records every request body and, in `events`, the order of what happened: ("request", prompts),
    ("finish", prompt), ("aborted", prompts)."""

    def __init__(self, scripts: dict, step_s: float = 0.002, fail=None):
        outer = self
        self.scripts, self.step_s, self.fail = scripts, step_s, fail
        self.bodies, self.events, self.lock = [], [], threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                data = json.dumps({"data": [{"id": "policy"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                outer.handle(self, json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def handle(self, handler, body):
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        keys = [self.key(p) for p in prompts]
        with self.lock:
            self.bodies.append(body)
            self.events.append(("request", keys))
            if self.fail == "400":
                handler.send_error(400, "prompt too long")
                return
        outputs = [self.scripts[k].turn(p, body["max_tokens"], body.get("stop") or []) for k, p in zip(keys, prompts)]
        if not body.get("stream"):  # one JSON reply with every choice
            choices = [
                {"index": i, "token_ids": out, "logprobs": {"token_logprobs": [-t / 100 for t in out]}}
                for i, out in enumerate(outputs)
            ]
            reply_json(handler, 200, {"choices": choices})
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream; charset=utf-8")
        handler.end_headers()
        interval = body.get("stream_interval") or 1
        sent = [0] * len(prompts)
        try:
            for step in range(1, max(map(len, outputs)) + 1):
                time.sleep(self.step_s)
                for i, out in enumerate(outputs):
                    done = step == len(out)
                    if step > len(out) or not (done or sent[i] == 0 or step - sent[i] >= interval):
                        continue
                    if self.fail == "drop" and done and i == len(outputs) - 1 and len(outputs) > 1:
                        return  # the connection goes away under the last sequence of a shared request
                    if self.fail == "error" and len(outputs) > 1 and done and i == len(outputs) - 1:
                        self.write(handler, {"error": {"message": "Internal server error", "code": 500}})
                        handler.wfile.write(b"data: [DONE]\n\n")
                        return
                    new = out[sent[i] : step]
                    choice = {
                        "index": i,
                        "token_ids": new,
                        "logprobs": {"token_logprobs": [-t / 100 for t in new]},
                        "finish_reason": "stop" if done else None,
                    }
                    if sent[i] == 0:
                        choice["prompt_token_ids"] = prompts[i]
                    self.write(handler, {"choices": [choice]})
                    sent[i] = step
                    if done:
                        with self.lock:
                            self.events.append(("finish", keys[i]))
            handler.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            with self.lock:
                self.events.append(("aborted", keys))

    @staticmethod
    def write(handler, chunk):
        handler.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        handler.wfile.flush()

    def key(self, sequence):
        return next(k for k in self.scripts if tuple(sequence[: len(k)]) == k)

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def prompts_and_scripts(texts):
    prompts = [ids_of(f"Q{i}:") for i in range(len(texts))]
    return prompts, {tuple(p): Script(p, t) for p, t in zip(prompts, texts)}


def rollout(texts, coalesce, step_s=0.002, fail=None, **engine_kwargs):
    prompts, scripts = prompts_and_scripts(texts)
    server = StreamingServer(scripts, step_s=step_s, fail=fail)
    try:
        engine = CompletionsEngine(
            server.url, TOKENIZER, "</code>", model="policy", coalesce=coalesce, **engine_kwargs
        )
        result = async_rollout(prompts, engine, FakeSandbox(), TOKENIZER, SPEC)
    finally:
        server.close()
    return result, server, engine


def test_coalescing_gives_the_same_completions_as_one_request_per_turn_with_fewer_requests():
    """The same ids, interpreter masks, sampling log-probs and reward kwargs as one plain request per turn, from
    fewer requests: every first turn goes in one request."""
    alone, alone_server, alone_engine = rollout(TEXTS, coalesce=False)
    ours, server, engine = rollout(TEXTS, coalesce=True)
    assert ours.completion_ids == alone.completion_ids
    assert ours.interpreter_mask == alone.interpreter_mask
    assert ours.logprobs == alone.logprobs
    assert ours.extra_fields() == alone.extra_fields()
    assert ours.num_tool_calls == [2, 1, 0, 3, 1] and not any(ours.infra_failed)
    turns = sum(ours.num_tool_calls) + len(TEXTS)
    assert len(alone_server.bodies) == alone_engine.requests == turns
    assert len(server.bodies) == engine.requests < turns and ours.engine_calls[0] == engine.requests
    first = server.bodies[0]
    assert first["prompt"] == prompts_and_scripts(TEXTS)[0] and first["stream"] is True
    assert first["n"] == 1 and first["stop"] == ["</code>"] and first["include_stop_str_in_output"] is True


def test_a_finished_sequence_goes_on_while_its_request_still_streams():
    """Row 0 ends its first turn long before row 1 does (a short and a long turn in one request): row 0 runs its
    snippet and its next turn reaches the server while row 1's first turn is still being decoded."""
    texts = ["<code>print(1)</code>\\boxed{1}", "word " * 60 + "\\boxed{2}"]
    result, server, _ = rollout(texts, coalesce=True, step_s=0.01)
    keys = list(prompts_and_scripts(texts)[1])
    assert server.events[0] == ("request", keys)
    second_request = server.events.index(("request", [keys[0]]))
    assert second_request < server.events.index(("finish", keys[1]))
    assert result.num_tool_calls == [1, 0] and not any(result.infra_failed)


def test_budgets_far_apart_go_in_separate_requests_and_each_turn_keeps_its_own():
    """One request has one token budget, so turns whose budgets differ by 2x or more are not coalesced (a turn that
    runs to its budget would decode far past it); within a request each turn is cut to its own budget."""
    prompts, scripts = prompts_and_scripts(["a" * 50, "b" * 50, "c" * 50])
    server = StreamingServer(scripts)

    async def three():
        async with CompletionsEngine(server.url, TOKENIZER, "</code>", model="policy") as engine:
            return await asyncio.gather(
                engine.generate(prompts[0], 10, True),
                engine.generate(prompts[1], 12, True),
                engine.generate(prompts[2], 40, True),
            )

    try:
        outs = asyncio.run(three())
    finally:
        server.close()
    assert [len(out.token_ids) for out in outs] == [10, 12, 40]
    assert sorted(
        (len(b["prompt"]) if isinstance(b["prompt"][0], list) else 1, b["max_tokens"]) for b in server.bodies
    ) == [
        (1, 40),
        (2, 12),
    ]


def test_a_connection_lost_mid_stream_fails_only_the_unfinished_turns():
    """The server goes away under a shared request: turns that finished before keep their tokens, the others are
    infrastructure failures (unscored, never -1)."""
    result, _, _ = rollout(["\\boxed{1}", "x " * 30 + "\\boxed{2}"], coalesce=True, fail="drop")
    assert result.infra_failed == [False, True]
    assert result.model_text[0] == "\\boxed{1}"


def test_a_failure_while_generating_is_an_engine_error():
    """vLLM reports a failure inside a streamed reply as an `error` chunk (the HTTP status is already 200)."""
    result, _, _ = rollout(["\\boxed{1}", "x " * 30 + "\\boxed{2}"], coalesce=True, fail="error")
    assert result.infra_failed == [False, True] and result.num_infra_errors == [0, 1]


def test_a_refused_coalesced_request_is_raised():
    """HTTP 4xx for a shared request (a prompt past the server's context): a configuration error, raised."""
    with pytest.raises(EngineRequestError, match="HTTP 400"):
        rollout(TEXTS[:2], coalesce=True, fail="400")


def test_a_turn_past_the_request_timeout_is_an_engine_timeout_and_its_stream_is_closed():
    """With `vllm_request_timeout_s`, a turn that takes longer fails alone as an engine timeout; a stream nobody
    waits on any more is closed (the server aborts its sequences) rather than decoded to its end."""
    result, server, _ = rollout(["\\boxed{1}", "x " * 100 + "\\boxed{2}"], coalesce=True, step_s=0.02, timeout_s=1.0)
    assert result.infra_failed == [False, True] and result.num_engine_timeouts == [0, 1]
    deadline = time.monotonic() + 10
    while not any(kind == "aborted" for kind, _ in server.events) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any(kind == "aborted" for kind, _ in server.events)


# ------------------------------------------------------------------ stream_interval on older vLLM servers
def test_a_server_that_ignores_stream_interval_gives_the_same_completions(monkeypatch):
    """Not a defect: vLLM reads `stream_interval` per request only in recent releases (vllm-project/vllm#49754; 0.32
    does); a server that predates it (the oldest supported is 0.22) accepts the field as an extra one (its request
    models allow extra fields, logged and ignored) and streams every token. The engine reads a stream of one token
    per chunk the same way: the same ids, masks, log-probs and reward kwargs as from a server that honours it, only
    in more chunks."""
    honoured, server, _ = rollout(TEXTS, coalesce=True)
    assert all(body["stream_interval"] > 1000 for body in server.bodies)
    handle = StreamingServer.handle

    def as_vllm_0_22(self, handler, body):
        body = {k: v for k, v in body.items() if k != "stream_interval"}  # an extra field: ignored
        return handle(self, handler, body)

    monkeypatch.setattr(StreamingServer, "handle", as_vllm_0_22)
    ignored, _, _ = rollout(TEXTS, coalesce=True)
    assert ignored.completion_ids == honoured.completion_ids and ignored.logprobs == honoured.logprobs
    assert ignored.interpreter_mask == honoured.interpreter_mask
    assert ignored.extra_fields() == honoured.extra_fields() and not any(ignored.infra_failed)
