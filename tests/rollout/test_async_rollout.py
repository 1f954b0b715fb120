"""The async rollout: each completion its own loop, same tokens/mask/facts as the barrier loop, failures as today."""

import asyncio
import json
import threading
import time

import httpx
import pytest

from helpers.async_scripted import SCRIPTS, SPEC, TOKENIZER, AsyncScripted, ThreadSafeSandbox, prompts
from retool_trl.rewards.functions import boxed_accuracy
from retool_trl.rollout import interleaved_rollout
from retool_trl.rollout.per_completion import CompletionsEngine, EngineError, async_rollout
from retool_trl.rollout.types import TurnOutput
from retool_trl.sandbox import LocalSandbox
from retool_trl.testing import ScriptedBackend


def test_same_tokens_mask_logprobs_and_facts_as_the_barrier_loop():
    barrier = interleaved_rollout(
        prompts(4), ScriptedBackend(TOKENIZER, SCRIPTS), ThreadSafeSandbox(), TOKENIZER, SPEC
    )
    result = async_rollout(prompts(4), AsyncScripted(SCRIPTS), ThreadSafeSandbox(), TOKENIZER, SPEC)
    assert result.completion_ids == barrier.completion_ids
    assert result.interpreter_mask == barrier.interpreter_mask
    assert result.logprobs == barrier.logprobs
    assert result.extra_fields() == barrier.extra_fields()
    assert result.num_tool_calls == [2, 0, 3, 1]
    assert sorted(result.exec_seconds) == sorted(barrier.exec_seconds)


def test_a_slow_snippet_does_not_hold_back_the_others():
    engine, sandbox = AsyncScripted(SCRIPTS, seconds_per_token=0.001), ThreadSafeSandbox()
    async_rollout(prompts(4), engine, sandbox, TOKENIZER, SPEC)
    slow_end = next(t for kind, code, t in sandbox.events if kind == "end" and code.startswith("slow"))
    # Row 0 ran both its cells and asked for its last turn while row 2's slow snippet was still running.
    row0_requests = [t for kind, row, t in engine.events if kind == "request" and row == 0]
    assert len(row0_requests) == 3 and row0_requests[-1] < slow_end
    # ...and row 3 ran its snippet in that time too.
    row3_cell = next(t for kind, code, t in sandbox.events if kind == "start" and code == "1/0")
    assert row3_cell < slow_end


def test_concurrency_bound_is_kept():
    in_flight, peak = [0], [0]

    class Counting(AsyncScripted):
        async def generate(self, *args):
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
            try:
                return await super().generate(*args)
            finally:
                in_flight[0] -= 1

    async_rollout(
        prompts(4), Counting(SCRIPTS, seconds_per_token=0.001), ThreadSafeSandbox(), TOKENIZER, SPEC, max_concurrency=2
    )
    assert peak[0] == 2


def test_dropped_connection_is_infrastructure_never_minus_one():
    engine = AsyncScripted(SCRIPTS, fail_on=(0, 2))  # row 0's second turn: the connection drops
    result = async_rollout(prompts(4), engine, ThreadSafeSandbox(), TOKENIZER, SPEC)
    assert result.infra_failed == [True, False, False, False]
    assert result.num_infra_errors[0] == 1
    rewards = boxed_accuracy(
        [""] * 4, ["42", "41", "3", "0"], model_text=result.model_text, infra_failed=result.infra_failed
    )
    assert rewards == [None, 1.0, 1.0, 1.0]


def test_real_sandbox_timeout_is_the_snippets_error_and_sessions_keep_state():
    scripts = ["<code>while True: pass</code>\\boxed{1}", "<code>y = 5</code>a<code>print(y * 2)</code>\\boxed{10}"]
    with LocalSandbox(num_workers=2, timeout_s=1.0) as sandbox:
        result = async_rollout(prompts(2), AsyncScripted(scripts), sandbox, TOKENIZER, SPEC)
    assert result.num_tool_timeouts == [1, 0] and result.infra_failed == [False, False]
    assert result.num_tool_errors == [1, 0]
    env = [
        TOKENIZER.decode([t for t, m in zip(ids, mask) if not m])
        for ids, mask in zip(result.completion_ids, result.interpreter_mask)
    ]
    assert "10" in env[1]


# ------------------------------------------------------------------- the HTTP client, against httpx's mock transport
def completions_server(replies, seen):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "policy"}]})
        body = json.loads(request.content)
        seen.append(body)
        reply = replies.pop(0)
        if isinstance(reply, int):
            return httpx.Response(reply, json={"error": "boom"})
        ids = TOKENIZER(reply, add_special_tokens=False)["input_ids"]
        return httpx.Response(
            200,
            json={
                "choices": [
                    {
                        "token_ids": ids,
                        "logprobs": {"token_logprobs": [-t / 100 for t in ids]},
                        "finish_reason": "stop",
                    }
                ]
            },
        )

    return httpx.MockTransport(handler)


def test_completions_engine_request_and_reply():
    seen = []
    transport = completions_server(["<code>print(1)</code>tail", "done"], seen)
    engine = CompletionsEngine(
        "http://127.0.0.1:9", TOKENIZER, "</code>", sampling={"temperature": 0.7, "top_k": 5}, transport=transport
    )

    async def two_turns():
        async with engine:
            first = await engine.generate([1, 2, 3], 50, True)
            second = await engine.generate([1, 2, 3, 4], 7, False)
        return first, second

    first, second = asyncio.run(two_turns())
    assert TOKENIZER.decode(first.token_ids) == "<code>print(1)</code>"  # tokens past the stop are cut
    assert first.logprobs == [-t / 100 for t in first.token_ids]
    assert seen[0]["prompt"] == [1, 2, 3] and seen[0]["max_tokens"] == 50 and seen[0]["model"] == "policy"
    assert seen[0]["stop"] == ["</code>"] and seen[0]["include_stop_str_in_output"] is True
    assert seen[0]["temperature"] == 0.7 and seen[0]["top_k"] == 5 and seen[0]["n"] == 1
    assert "stop" not in seen[1] and seen[1]["max_tokens"] == 7
    assert TOKENIZER.decode(second.token_ids) == "done"


@pytest.mark.parametrize("failure", [500, "connect"])
def test_completions_engine_failures_raise_engine_error(failure):
    if failure == "connect":

        def handler(request):
            raise httpx.ConnectError("connection refused", request=request)

        transport = httpx.MockTransport(handler)
    else:
        transport = completions_server([failure], [])
    engine = CompletionsEngine("http://127.0.0.1:9", TOKENIZER, "</code>", model="policy", transport=transport)

    async def one():
        async with engine:
            return await engine.generate([1], 5, True)

    with pytest.raises(EngineError):
        asyncio.run(one())


def test_runs_inside_a_running_event_loop():
    async def notebook():
        return async_rollout(prompts(2), AsyncScripted(SCRIPTS[:2]), ThreadSafeSandbox(), TOKENIZER, SPEC)

    assert asyncio.run(notebook()).num_tool_calls == [2, 0]


def test_trainer_takes_the_async_path_in_server_mode(tmp_path):
    import torch
    from datasets import Dataset

    from helpers.testing_utils import FakeVLLMGeneration
    from retool_trl import ReToolConfig, ReToolTrainer
    from retool_trl.models.tiny import save_tiny_model
    from retool_trl.testing import FakeSandbox

    class Logprobs(AsyncScripted):  # vLLM-style sampling logprobs: -token/1000, to check alignment
        async def generate(self, *args):
            out = await super().generate(*args)
            return TurnOutput(out.token_ids, [-t / 1000 for t in out.token_ids])

    scripts = SCRIPTS[:2] + SCRIPTS[3:]
    args = ReToolConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=3,
        num_generations=3,
        max_completion_length=96,
        report_to="none",
        bf16=False,
        use_cpu=True,
    )
    assert args.rollout_mode == "async"
    trainer = ReToolTrainer(
        save_tiny_model(tmp_path / "m", TOKENIZER),
        reward_funcs=lambda completions, **k: [0.0, 1.0, 2.0],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "Q:"}] * 3),
        processing_class=TOKENIZER,
        sandbox=FakeSandbox(),
    )
    helper = FakeVLLMGeneration(TOKENIZER, scripts)
    helper.mode = "server"  # the barrier helper must not be called: every turn goes through the async engine
    helper.generate = None
    engines = []
    trainer._make_async_engine = lambda: engines.append(Logprobs(scripts)) or engines[-1]
    trainer.use_vllm, trainer.vllm_generation = True, helper
    trainer._last_loaded_step = 0
    trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode = "token_truncate"
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = trainer._generate_and_score_completions([{"prompt": "Q:"}] * 3)
    assert len(engines) == 1 and engines[0].turns == [3, 1, 3]
    assert trainer._metrics["train"]["retool/engine_timeout_ratio"] == [0.0]  # logged, apart from other failures
    tool_mask, ids, real = inputs["tool_mask"].bool(), inputs["completion_ids"], inputs["completion_mask"].bool()
    assert (~tool_mask & real).any()
    assert torch.allclose(inputs["sampling_per_token_logps"][tool_mask & real], -ids[tool_mask & real].float() / 1000)
    assert torch.all(inputs["importance_sampling_ratio"][~tool_mask & real] == 1.0)


def test_local_sandbox_serves_many_threads_at_once():
    """The async rollout runs each completion's cells from its own thread: sessions must not mix up."""
    import concurrent.futures

    with LocalSandbox(num_workers=2, timeout_s=5.0) as sandbox:

        def three_cells(i):
            session = sandbox.session()
            try:
                return [
                    sandbox.run_many(
                        [(session, f"x = {i} * 10 + {k}\nimport time; time.sleep(0.01 * ({i} % 3))\nprint(x)")]
                    )[0]
                    for k in range(3)
                ]
            finally:
                session.close()

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(three_cells, range(32)))
    for i, cells in enumerate(results):
        assert [(r.ok, r.infra_error, r.output.strip()) for r in cells] == [
            (True, False, str(i * 10 + k)) for k in range(3)
        ]


def test_a_refused_request_is_raised_not_dropped():
    """HTTP 4xx (context past the server's length, an unknown field) is a configuration error: the rollout stops
    and says so, rather than quietly dropping the rows from the loss as infrastructure failures."""
    from retool_trl.rollout.per_completion import EngineRequestError
    from retool_trl.testing import FakeSandbox

    engine = CompletionsEngine(
        "http://127.0.0.1:9", TOKENIZER, "</code>", model="policy", transport=completions_server([400, 400], [])
    )
    sandbox = FakeSandbox()
    with pytest.raises(EngineRequestError, match="HTTP 400"):
        async_rollout(prompts(2), engine, sandbox, TOKENIZER, SPEC)


def test_gil_slices_are_short_while_the_rollout_runs_and_restored_after():
    """The loop's thread is busy (stepping the colocated engine) while every snippet's thread needs the GIL back after
    each system call of a sandbox call: with the interpreter's 5 ms slices, 32 threads of sleeping cells beside one
    busy thread measured 420 ms of overhead per call. The rollout shortens the slices while it runs, and two rollouts
    at once from two threads leave the setting as they found it."""
    import sys

    seen = []

    class Recording(ThreadSafeSandbox):
        def run_many(self, pairs):
            seen.append(sys.getswitchinterval())
            time.sleep(0.05)  # keeps both rollouts in flight together
            return super().run_many(pairs)

    before = sys.getswitchinterval()
    errors = []

    def one():
        try:
            async_rollout(prompts(4), AsyncScripted(SCRIPTS), Recording(), TOKENIZER, SPEC)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors
    assert seen and max(seen) <= 0.0002 + 1e-9, seen
    assert sys.getswitchinterval() == before
