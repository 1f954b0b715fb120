"""The async rollout on a colocated engine, driven request by request (no vLLM needed: a fake `LLMEngine`).

The fake has vLLM's request-level interface (`add_request`, `step`, `abort_request`): every step decodes one token
of each request in flight, and a request finishes at EOS, its budget or a stop string, as in vLLM. The real engine is
tested in tests/engines/test_engine_vllm.py.
"""

import threading
import time
import types

import pytest

from helpers.async_scripted import SCRIPTS, ThreadSafeSandbox
from helpers.testing_utils import make_char_tokenizer
from retool_trl.rollout import RolloutSpec, interleaved_rollout
from retool_trl.rollout.engines.vllm_colocate import ColocateEngine
from retool_trl.rollout.per_completion import async_rollout
from retool_trl.testing import ScriptedBackend

TOKENIZER = make_char_tokenizer()
EOS = TOKENIZER.eos_token_id
SPEC = RolloutSpec(max_completion_length=200, eos_token_ids=[EOS], max_tool_calls=4)


class FakeLLMEngine:
    """vLLM's `LLMEngine` request API over fixed scripts (one per prompt of the first turn), one token per step."""

    def __init__(self, scripts, fail_at_step=None):
        self.scripts = [TOKENIZER(s, add_special_tokens=False)["input_ids"] for s in scripts]
        self.prompt_len = None
        self.running: dict[str, dict] = {}
        self.steps, self.aborted, self.fail_at_step = 0, [], fail_at_step
        self.events: list[tuple[str, str, float]] = []
        self.lock = threading.Lock()

    def _script(self, prompt):
        # Which script: the first turn's prompts are "Q:" + an index character; later turns continue them.
        return int(TOKENIZER.decode(prompt[2:3]))

    def add_request(self, request_id, prompt, params):
        ids = prompt["prompt_token_ids"]
        row = self._script(ids)
        # Where the script stands: its tokens written so far (the sequence without the interpreter blocks).
        text = TOKENIZER.decode(ids[3:])
        while "<interpreter>" in text:
            head, _, rest = text.partition("<interpreter>")
            text = head + rest.partition("</interpreter>")[2]
        cursor = len(TOKENIZER(text, add_special_tokens=False)["input_ids"])
        self.running[request_id] = {"row": row, "cursor": cursor, "out": [], "params": params}
        with self.lock:
            self.events.append(("add", request_id, time.monotonic()))

    def step(self):
        self.steps += 1
        if self.fail_at_step == self.steps:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        time.sleep(0.002)
        finished = []
        for request_id, req in list(self.running.items()):
            ids = self.scripts[req["row"]]
            token = ids[req["cursor"]] if req["cursor"] < len(ids) else EOS
            req["cursor"] += 1
            req["out"].append(token)
            params = req["params"]
            done = token == EOS or len(req["out"]) >= params.max_tokens
            done |= any(stop in TOKENIZER.decode(req["out"]) for stop in params.stop)
            if done:
                del self.running[request_id]
                logprobs = [{t: types.SimpleNamespace(logprob=-0.5)} for t in req["out"]]
                reason = "stop" if token == EOS or len(req["out"]) < params.max_tokens else "length"
                completion = types.SimpleNamespace(token_ids=req["out"], logprobs=logprobs, finish_reason=reason)
                finished.append(types.SimpleNamespace(request_id=request_id, finished=True, outputs=[completion]))
                with self.lock:
                    self.events.append(("finish", request_id, time.monotonic()))
        return finished

    def has_unfinished_requests(self):
        return bool(self.running)

    def abort_request(self, request_ids):
        self.aborted += list(request_ids)
        for request_id in request_ids:
            self.running.pop(request_id, None)


class FakeHelper:
    """TRL's colocate-mode `VLLMGeneration` attributes the engine reads, with sleep-mode bookkeeping."""

    mode, tensor_parallel_size = "colocate", 1

    def __init__(self, engine, enable_sleep_mode=False):
        self.generation_kwargs, self.structured_outputs_regex = {}, None
        self.enable_sleep_mode = self._llm_weights_sleeping = enable_sleep_mode
        self.calls: list[str] = []
        self.llm = types.SimpleNamespace(
            llm_engine=engine,
            wake_up=lambda tags=None: self.calls.append(f"wake_up{tags}"),
            sleep=lambda level: self.calls.append(f"sleep{level}"),
        )

    def sync_weights(self):
        self.calls.append("sync_weights")
        self._llm_weights_sleeping = False


@pytest.fixture(autouse=True)
def plain_sampling_params(monkeypatch):
    # vLLM's SamplingParams, reduced to what the fake engine reads (vLLM is not installed in the fast suite).
    def params(self, max_tokens, stop_at_code_end):
        stops = [*self.stops, self.code_end] if stop_at_code_end else list(self.stops)
        return types.SimpleNamespace(max_tokens=max_tokens, stop=stops)

    monkeypatch.setattr(ColocateEngine, "sampling_params", params)


def indexed_prompts(n):
    return [TOKENIZER(f"Q:{i}", add_special_tokens=False)["input_ids"] for i in range(n)]


def test_colocate_async_gives_the_barrier_loops_result():
    """Same tokens, mask, log-probs and reward kwargs as the batched loop, turn by turn through the request API."""
    barrier = interleaved_rollout(
        indexed_prompts(4), ScriptedBackend(TOKENIZER, SCRIPTS), ThreadSafeSandbox(), TOKENIZER, SPEC
    )
    engine = FakeLLMEngine(SCRIPTS)
    result = async_rollout(
        indexed_prompts(4),
        ColocateEngine(FakeHelper(engine), TOKENIZER, "</code>"),
        ThreadSafeSandbox(),
        TOKENIZER,
        SPEC,
    )
    assert result.completion_ids == barrier.completion_ids
    assert result.interpreter_mask == barrier.interpreter_mask
    assert result.logprobs == barrier.logprobs
    assert result.extra_fields() == barrier.extra_fields()
    assert result.num_tool_calls == [2, 0, 3, 1]
    assert not engine.running and not engine.aborted


def test_the_engine_keeps_decoding_while_a_snippet_runs():
    """Row 2's snippet sleeps 0.3 s; meanwhile the engine finishes other rows' turns and takes their continuations
    (the barrier loop would wait for that snippet before any row's next turn)."""
    engine, sandbox = FakeLLMEngine(SCRIPTS), ThreadSafeSandbox()
    async_rollout(
        indexed_prompts(4), ColocateEngine(FakeHelper(engine), TOKENIZER, "</code>"), sandbox, TOKENIZER, SPEC
    )
    slow = [t for kind, code, t in sandbox.events if code.startswith("slow")]
    during = [kind for kind, _, t in engine.events if slow[0] < t < slow[1]]
    assert "add" in during and "finish" in during


def test_sleep_mode_wakes_once_per_rollout():
    """With sleep mode, TRL's helper would sleep after every call (and push all weights again); the rollout wakes the
    engine once, with the weights, and puts it back to sleep at its end."""
    helper = FakeHelper(FakeLLMEngine(SCRIPTS), enable_sleep_mode=True)
    async_rollout(
        indexed_prompts(4), ColocateEngine(helper, TOKENIZER, "</code>"), ThreadSafeSandbox(), TOKENIZER, SPEC
    )
    assert helper.calls == ["sync_weights", "wake_up['kv_cache']", "sleep2"]
    assert helper.enable_sleep_mode and helper._llm_weights_sleeping


def test_an_engine_failure_is_raised_and_leaves_no_request_behind():
    """A failing engine (a CUDA error) is not the model's fault, nor an outage to score around: the rollout stops
    with the engine's error, and no request of the rollout stays in the engine."""
    engine = FakeLLMEngine(SCRIPTS, fail_at_step=5)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        async_rollout(
            indexed_prompts(4),
            ColocateEngine(FakeHelper(engine), TOKENIZER, "</code>"),
            ThreadSafeSandbox(),
            TOKENIZER,
            SPEC,
        )
    assert not engine.running or set(engine.running) <= set(engine.aborted)


def test_tensor_parallel_engines_are_refused():
    helper = FakeHelper(FakeLLMEngine(SCRIPTS))
    helper.tensor_parallel_size = 2
    with pytest.raises(ValueError, match="rollout_mode='barrier'"):
        ColocateEngine(helper, TOKENIZER, "</code>")
