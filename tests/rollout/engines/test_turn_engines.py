"""How the vLLM turn engines talk to vLLM: request timeouts, padding rows, users' stop strings, log-prob counts.

No vLLM needed: a real HTTP server on 127.0.0.1 speaking the completions API, TRL's own server-mode `generate` with a
fake client, and fakes with the interface of TRL's vLLM helper.
"""

import json
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from helpers.scripted_turns import EOS, TOKENIZER, Script, ids_of
from helpers.testing_utils import reply_json, trl_server_generation
from retool_trl import ReToolConfig
from retool_trl.rewards.functions import boxed_accuracy
from retool_trl.rollout import RolloutSpec, interleaved_rollout
from retool_trl.rollout.engines.vllm_batched import VLLMBackend
from retool_trl.rollout.engines.vllm_server import server_engine_from_config
from retool_trl.rollout.per_completion import CompletionsEngine, EngineError, async_rollout
from retool_trl.testing import FakeSandbox

SPEC = RolloutSpec(max_completion_length=200, eos_token_ids=[EOS], max_tool_calls=1)


# ------------------------------------------------------------------------------------------------- slow server
class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # a client that gave up (the request-timeout case) leaves a broken pipe: expected


class SlowServer:
    """vLLM's completions API on 127.0.0.1, each reply `delay_s` late (a long turn on a loaded server)."""

    def __init__(self, script: Script, delay_s: float):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                reply_json(self, 200, {"data": [{"id": "policy"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                time.sleep(outer.delay_s)
                ids = script.turn(body["prompt"], body["max_tokens"], body.get("stop") or [])
                reply_json(
                    self, 200, {"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": [-0.1] * len(ids)}}]}
                )

        self.delay_s = delay_s
        self.httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


TRL_SAMPLING = types.SimpleNamespace(
    temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, generation_kwargs={}
)


@pytest.mark.parametrize("request_timeout", [None, 0.2], ids=["no-limit", "user-limit"])
def test_a_turn_longer_than_the_server_start_timeout_is_scored(tmp_path, request_timeout):
    """A 14k-token turn on a loaded server takes minutes. `vllm_server_timeout` (TRL: how long to wait for the server
    to *start*) must not cut it: the turn completes and is scored. Only a request timeout the user sets does, and
    then it is counted as an engine timeout of its own (the row unscored, never -1)."""
    args = ReToolConfig(
        output_dir=str(tmp_path),
        vllm_server_timeout=0.3,
        vllm_request_timeout_s=request_timeout,
        max_completion_length=200,
        report_to="none",
        use_cpu=True,
    )
    prompt = ids_of("Q:")
    server = SlowServer(Script(prompt, "<code>print(6 * 7)</code>so \\boxed{42}"), delay_s=0.8)
    try:
        engine = server_engine_from_config(args, TOKENIZER, TRL_SAMPLING, server.url)
        result = async_rollout([prompt], engine, FakeSandbox(), TOKENIZER, SPEC)
    finally:
        server.close()
    reward = boxed_accuracy([""], ["42"], model_text=result.model_text, infra_failed=result.infra_failed)
    if request_timeout is None:
        assert result.infra_failed == [False] and result.num_tool_calls == [1] and reward == [1.0]
        assert result.num_engine_timeouts == [0]
    else:
        assert result.infra_failed == [True] and result.num_engine_timeouts == [1] and reward == [None]


def test_config_refuses_a_non_positive_request_timeout(tmp_path):
    with pytest.raises(ValueError, match="vllm_request_timeout_s must be > 0"):
        ReToolConfig(output_dir=str(tmp_path), vllm_request_timeout_s=0, report_to="none")


# ------------------------------------------------------------------------------------- padding rows, server mode
class CountingClient:
    """TRL's `VLLMClient.generate` interface; decodes `max_tokens` tokens per prompt and counts them."""

    def __init__(self):
        self.decoded, self.sent = 0, []

    def generate(self, prompts, features=None, n=1, max_tokens=16, logprobs=0, generation_kwargs=None, **sampling):
        assert n == 1 and features is None
        self.sent.append(len(prompts))
        self.decoded += len(prompts) * max_tokens
        ids = [[ids_of("a")[0]] * max_tokens for _ in prompts]
        return {
            "prompt_ids": [list(p) for p in prompts],
            "completion_ids": ids,
            "logprobs": [[[-0.1]] * len(x) for x in ids],
            "logprob_token_ids": [[[t] for t in x] for x in ids],
        }


def test_padding_rows_make_the_server_decode_nothing(monkeypatch):
    """Two training processes share one vLLM server; this one has 1 sequence left, the other 3. TRL's helper gathers
    3 prompts from each process, so this process sends 2 padding rows. They must cost the server no decoding: the
    server decodes the 4 real rows, each up to the budget, and nothing for the padding."""
    from trl.generation import vllm_generation as trl_vllm

    other_rank = [ids_of("R1:"), ids_of("R2:"), ids_of("R3:")]
    # `gather_object` is called for the prompts, then for the (absent) images.
    monkeypatch.setattr(trl_vllm, "gather_object", lambda xs: list(xs) + (other_rank if xs[0] else [None] * 3))
    accelerator = types.SimpleNamespace(
        num_processes=2, process_index=0, is_main_process=True, device=torch.device("cpu")
    )
    # The other process: 3 rows that may call code, budget 50 (the plan this process receives from the gather, then
    # each row's own budget: 3 slots that may call code, none that may not).
    accelerator.gather = lambda local: torch.cat([local, torch.tensor([3, 50, 0, 0] if len(local) == 4 else [50] * 3)])
    helper = trl_server_generation(accelerator, CountingClient())  # TRL's own server-mode `generate`
    backend = VLLMBackend(helper, TOKENIZER, "</code>", accelerator=accelerator)
    [out] = backend.generate_turn([ids_of("Q:")], [40], [True])
    assert len(out.token_ids) == 40 and out.logprobs == [-0.1] * 40  # this process's row, cut to its own budget
    assert helper.vllm_client.sent == [4]
    assert helper.vllm_client.decoded == 4 * 50  # before: 6 * 50, two padding rows decoding the whole budget
    assert "generate" not in vars(helper.vllm_client)  # the client is as it was


# ---------------------------------------------------------------------------------------- users' stop strings
class StopHelper:
    """TRL's vLLM helper interface over one `Script`, honouring `generation_kwargs["stop"]` as vLLM does."""

    mode = "colocate"

    def __init__(self, script, logprob_shortfall=0):
        self.script, self.shortfall = script, logprob_shortfall
        self.max_completion_length, self.generation_kwargs = 10_000, {"stop": ["###"]}

    def generate(self, prompts, images, num_generations, profiler=None):
        stops = self.generation_kwargs.get("stop") or []
        ids = [self.script.turn(p, self.max_completion_length, stops) for p in prompts]
        return prompts, ids, [[[-0.1]] * (len(x) - self.shortfall) for x in ids], None


SCRIPTS = {
    "stop-on-a-code-turn": ("A###B<code>print(1)</code>C", "A###"),
    "stop-after-the-last-call": ("<code>print(1)</code>x###y", "<code>print(1)</code>x###"),
}


@pytest.mark.parametrize("case", SCRIPTS)
def test_a_users_stop_string_ends_the_completion_on_every_turn_barrier(case):
    """`generation_kwargs={"stop": ["###"]}` ends a completion at `###` (as TRL's own rollout does), whether or not the
    turn may still call code. Before, the code-end stop replaced it on code turns, and on the others it stopped the
    turn without ending the completion (the rollout then asked for the rest)."""
    text, expected = SCRIPTS[case]
    prompt = ids_of("Q:")
    helper = StopHelper(Script(prompt, text))
    result = interleaved_rollout([prompt], VLLMBackend(helper, TOKENIZER, "</code>"), FakeSandbox(), TOKENIZER, SPEC)
    assert result.model_text == [expected]
    assert helper.generation_kwargs == {"stop": ["###"]}  # restored


@pytest.mark.parametrize("case", SCRIPTS)
def test_a_users_stop_string_ends_the_completion_on_every_turn_async(case, tmp_path):
    """As above, in the async rollout against a server (the user's `stop` comes in TRL's sampling settings)."""
    text, expected = SCRIPTS[case]
    prompt = ids_of("Q:")
    script = Script(prompt, text)
    server = SlowServer(script, delay_s=0.0)
    sampling = types.SimpleNamespace(**{**vars(TRL_SAMPLING), "generation_kwargs": {"stop": ["###"]}})
    args = ReToolConfig(output_dir=str(tmp_path), max_completion_length=200, report_to="none", use_cpu=True)
    try:
        engine = server_engine_from_config(args, TOKENIZER, sampling, server.url)
        result = async_rollout([prompt], engine, FakeSandbox(), TOKENIZER, SPEC)
    finally:
        server.close()
    assert result.model_text == [expected]
    assert all("###" in stops for stops in script.requests)


def test_fewer_logprobs_than_tokens_is_an_engine_error_barrier():
    """A server that returns fewer log-probs than tokens (an incompatible server, a proxy that trims them) would
    shift every sampling log-prob onto the wrong token in TRL's importance-sampling correction: refuse, saying so."""
    prompt = ids_of("Q:")
    helper = StopHelper(Script(prompt, "hello"), logprob_shortfall=1)
    with pytest.raises(EngineError, match="5 log-probs for 6 tokens"):
        interleaved_rollout([prompt], VLLMBackend(helper, TOKENIZER, "</code>"), FakeSandbox(), TOKENIZER, SPEC)


def test_fewer_logprobs_than_tokens_is_an_engine_error_async():
    import asyncio

    import httpx

    def handler(request):
        return httpx.Response(200, json={"choices": [{"token_ids": [5, 6, 7], "logprobs": {"token_logprobs": [-1]}}]})

    engine = CompletionsEngine(
        "http://127.0.0.1:9", TOKENIZER, "</code>", model="policy", transport=httpx.MockTransport(handler)
    )

    async def one():
        async with engine:
            return await engine.generate([1], 5, True)

    with pytest.raises(EngineError, match="1 log-probs for 3 tokens"):
        asyncio.run(one())
