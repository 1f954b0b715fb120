"""ReTool on a real vLLM engine (vLLM's CPU build), colocate and server mode, with the shipped quickstart model.

Run by `bash scripts/test_engines.sh` in `.venv-engines/`; skipped where vLLM is not installed (the fast suite).
"""

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

import torch  # noqa: E402
from trl.generation.vllm_client import VLLMClient  # noqa: E402

from helpers.engine_helpers import (  # noqa: E402
    VLLMServer,
    assert_same_rollout,
    engine_config,
    greedy_generation_config,
    policy_logprobs,
    quickstart_dataset,
    vllm_prompt_logprobs,
)
from retool_trl import ReToolTrainer  # noqa: E402
from retool_trl.quickstart import model_path  # noqa: E402
from retool_trl.rollout import RolloutSpec, interleaved_rollout  # noqa: E402
from retool_trl.rollout.engines.transformers_generate import TransformersBackend  # noqa: E402
from retool_trl.rollout.engines.vllm_batched import VLLMBackend  # noqa: E402
from retool_trl.rollout.engines.vllm_server import CompletionsEngine  # noqa: E402
from retool_trl.sandbox import LocalSandbox  # noqa: E402


@pytest.fixture(scope="module")
def colocate_trainer(tmp_path_factory, tokenizer, sandbox):
    """One colocated engine for the module (vLLM runs one engine per process in colocate mode)."""
    args = engine_config(
        tmp_path_factory.mktemp("colocate"), use_vllm=True, vllm_mode="colocate", learning_rate=1e-3, beta=0.0
    )
    trainer = ReToolTrainer(
        model_path(), args=args, train_dataset=quickstart_dataset(16), processing_class=tokenizer, sandbox=sandbox
    )
    return trainer


def prompt_ids_of(tokenizer, n=16, seed=1):
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in quickstart_dataset(n, seed=seed)["prompt"]]


def greedy_transformers_rollout(model, tokenizer, sandbox, prompts, spec):
    backend = TransformersBackend(
        model, tokenizer, greedy_generation_config(tokenizer), "</code>", [tokenizer.eos_token_id]
    )
    return interleaved_rollout(prompts, backend, sandbox, tokenizer, spec)


def greedy_vllm_rollout(helper, tokenizer, sandbox, prompts, spec):
    saved, helper.temperature = helper.temperature, 0.0
    try:
        return interleaved_rollout(prompts, VLLMBackend(helper, tokenizer, "</code>"), sandbox, tokenizer, spec)
    finally:
        helper.temperature = saved


def test_colocate_greedy_rollout_equals_transformers(colocate_trainer, tokenizer, sandbox):
    spec = RolloutSpec(max_completion_length=64, eos_token_ids=[tokenizer.eos_token_id], max_tool_calls=2)
    prompts = prompt_ids_of(tokenizer)
    ours = greedy_vllm_rollout(colocate_trainer.vllm_generation, tokenizer, sandbox, prompts, spec)
    reference = greedy_transformers_rollout(colocate_trainer.model, tokenizer, sandbox, prompts, spec)
    assert sum(ours.num_tool_calls) > 0, "the workload must call code"
    assert ours.completion_ids == reference.completion_ids
    assert ours.interpreter_mask == reference.interpreter_mask
    assert ours.num_tool_calls == reference.num_tool_calls
    # One engine call per turn: no row stops at a `</code>` it can no longer run.
    assert ours.engine_calls[0] <= max(reference.num_turns) + 1


# Before the tests below train and perturb the shared engine's weights (the quickstart model must still call code).
def greedy_colocate_async(helper, tokenizer, sandbox, prompts, spec):
    from retool_trl.rollout.engines.vllm_colocate import ColocateEngine
    from retool_trl.rollout.per_completion import async_rollout

    saved, helper.temperature = helper.temperature, 0.0
    try:
        return async_rollout(
            prompts, ColocateEngine(helper, tokenizer, "</code>"), sandbox, tokenizer, spec, max_concurrency=8
        )
    finally:
        helper.temperature = saved


@pytest.mark.parametrize("snippet_timeout", [False, True], ids=["ok", "snippet-timeout"])
def test_colocate_async_rollout_equals_barrier(colocate_trainer, tokenizer, snippet_timeout):
    """Each completion its own loop on the colocated engine (request-level API): the same completions, masks,
    log-probs and reward kwargs as the batched per-turn loop through TRL's `LLM.generate`, under greedy decoding."""
    helper = colocate_trainer.vllm_generation
    spec = RolloutSpec(max_completion_length=64, eos_token_ids=[tokenizer.eos_token_id], max_tool_calls=2)
    prompts = prompt_ids_of(tokenizer, n=12, seed=4)
    with LocalSandbox(num_workers=2, timeout_s=0.5 if snippet_timeout else 10.0) as inner:
        box = SleepsFirst(inner) if snippet_timeout else inner
        barrier = greedy_vllm_rollout(helper, tokenizer, box, prompts, spec)
        ours = greedy_colocate_async(helper, tokenizer, box, prompts, spec)
    assert_same_rollout(ours, barrier, snippet_timeout)
    assert ours.engine_calls[0] == sum(ours.num_turns)  # one request per turn of each completion
    assert not helper.llm.llm_engine.has_unfinished_requests()


def test_colocate_trainer_trains_through_vllm(colocate_trainer):
    colocate_trainer.train()
    logs = [h for h in colocate_trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for entry in logs:
        assert entry["retool/engine_calls_per_rollout"] >= 1
        assert torch.isfinite(torch.tensor(entry["loss"]))
    # Step 2 sampled from the weights synced after step 1's update (learning rate 1e-3): vLLM's sampling log-probs
    # still match the trainer's, up to the CPU kernels' rounding (the perturbation test below isolates the sync).
    assert logs[1]["sampling/sampling_logp_difference/mean"] < 0.05
    assert colocate_trainer.state.global_step == 2
    # The weight sync to the real engine is a stage of its own, out of generation, and the shares still add up.
    assert logs[1]["retool/time/weight_sync"] > 0 and logs[1]["retool/time/generation"] > 0
    stages = ("generation", "interpreter", "weight_sync", "rewards", "logprobs", "update", "other")
    for entry in logs:
        assert sum(entry[f"retool/time/{stage}_share"] for stage in stages) == pytest.approx(1.0, abs=0.05)


def test_colocate_weight_sync_reaches_the_engine(colocate_trainer, tokenizer):
    helper, model = colocate_trainer.vllm_generation, colocate_trainer.model
    ids = tokenizer("What is 12*34?\n<code>print(12*34)</code>", add_special_tokens=False)["input_ids"]

    def gap(engine, policy):  # mean absolute log-prob difference over the sequence
        return (engine - policy).abs().mean().item()

    before = policy_logprobs(model, ids)
    helper.sync_weights()  # training's last update has not reached the engine yet (TRL syncs before generating)
    engine = vllm_prompt_logprobs(helper.llm, ids)
    # vLLM's CPU kernels are not bit-identical to torch's; the gap is small next to the perturbation below.
    assert gap(engine, before) < 0.05
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    after = policy_logprobs(model, ids)
    assert gap(after, before) > 0.3  # the perturbation is visible
    # Without a sync the engine still has the old weights...
    engine = vllm_prompt_logprobs(helper.llm, ids)
    assert gap(engine, before) < 0.05 and gap(engine, after) > 0.25
    helper.sync_weights()  # what TRL's `_generate` calls at each new step (here: through vLLM's reload API)
    # ...after it, the engine's log-probs follow the policy.
    engine = vllm_prompt_logprobs(helper.llm, ids)
    assert gap(engine, after) < 0.05 and gap(engine, before) > 0.25


# ------------------------------------------------------------------------------------------------ server mode
@pytest.fixture(scope="module")
def server():
    server = VLLMServer(model_path())
    yield server
    server.stop()


@pytest.fixture
def no_nccl_communicator(monkeypatch):
    # TRL's server-mode weight sync opens an NCCL group with the server at init; NCCL needs CUDA, so on CPU the
    # rollout is tested without it (weights are the server's own, i.e. the initial checkpoint).
    monkeypatch.setattr(VLLMClient, "init_communicator", lambda self, device=None: None)


def test_server_mode_rollout_through_a_real_server(server, no_nccl_communicator, tokenizer, sandbox, tmp_path):
    args = engine_config(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=server.base_url)
    trainer = ReToolTrainer(
        model_path(), args=args, train_dataset=quickstart_dataset(16), processing_class=tokenizer, sandbox=sandbox
    )
    spec = RolloutSpec(max_completion_length=64, eos_token_ids=[tokenizer.eos_token_id], max_tool_calls=2)
    prompts = prompt_ids_of(tokenizer)
    ours = greedy_vllm_rollout(trainer.vllm_generation, tokenizer, sandbox, prompts, spec)
    reference = greedy_transformers_rollout(trainer.model, tokenizer, sandbox, prompts, spec)
    assert sum(ours.num_tool_calls) > 0
    assert ours.completion_ids == reference.completion_ids
    assert ours.interpreter_mask == reference.interpreter_mask
    # TRL's own `_generate` path (what training runs): token ids, tool mask and log-probs line up.
    trainer._last_loaded_step = trainer.state.global_step  # no weight sync: it needs NCCL (see fixture)
    trainer.model.train()
    _, completion_ids, tool_mask, _, logprobs, extra, *_ = trainer._generate(
        list(quickstart_dataset(8, seed=2)["prompt"])
    )
    assert [len(m) for m in tool_mask] == [len(c) for c in completion_ids] == [len(lp) for lp in logprobs]
    assert sum(extra["num_tool_calls"]) >= 0


def test_server_mode_two_processes_with_different_turns(server, no_nccl_communicator, tokenizer, sandbox, tmp_path):
    import json

    from helpers.engine_helpers import launch

    spec = RolloutSpec(max_completion_length=64, eos_token_ids=[tokenizer.eos_token_id], max_tool_calls=2)
    texts = list(quickstart_dataset(4, seed=1)["prompt"])
    # Rank 1's prompts already hold the interpreter's answer (a partly solved trace): one turn, no call. Rank 0's are
    # plain problems, which the quickstart model answers with one call: two turns.
    solved = [f"{t}<code>print({t[8:-2]})</code><interpreter>{eval(t[8:-2])}\n</interpreter>" for t in texts[2:]]
    prompts = texts[:2] + solved
    args = engine_config(tmp_path / "one", use_vllm=True, vllm_mode="server", vllm_server_base_url=server.base_url)
    trainer = ReToolTrainer(
        model_path(), args=args, train_dataset=quickstart_dataset(16), processing_class=tokenizer, sandbox=sandbox
    )
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    single = greedy_vllm_rollout(trainer.vllm_generation, tokenizer, sandbox, ids, spec)
    assert single.num_turns[:2] == [2, 2] and single.num_turns[2:] == [1, 1], single.num_turns
    (tmp_path / "two").mkdir()
    (tmp_path / "two" / "prompts.json").write_text(json.dumps([prompts[:2], prompts[2:]]))
    ranks = launch("vllm_server", tmp_path / "two", 2, server.base_url)
    for mode in ("barrier", "async"):
        for i, prompt in enumerate(prompts):
            ((text, mask),) = ranks[i // 2]["completions"][mode][prompt]
            assert text == tokenizer.decode(single.completion_ids[i]), mode
            assert mask == single.interpreter_mask[i], mode


# ------------------------------------------------------------------------------------------- async rollout (server)
@pytest.fixture(scope="module")
def server_trainer(server, tokenizer, sandbox, tmp_path_factory):
    from trl.generation import vllm_client

    # As `no_nccl_communicator`, for the module (a module fixture cannot use the function-scoped monkeypatch).
    original = vllm_client.VLLMClient.init_communicator
    vllm_client.VLLMClient.init_communicator = lambda self, device=None: None
    args = engine_config(
        tmp_path_factory.mktemp("server"), use_vllm=True, vllm_mode="server", vllm_server_base_url=server.base_url
    )
    try:
        yield ReToolTrainer(
            model_path(), args=args, train_dataset=quickstart_dataset(16), processing_class=tokenizer, sandbox=sandbox
        )
    finally:
        vllm_client.VLLMClient.init_communicator = original


def greedy_engine(server, tokenizer, transport=None, coalesce=True):
    from retool_trl.rollout.per_completion import CompletionsEngine

    return CompletionsEngine(
        server.base_url, tokenizer, "</code>", sampling={"temperature": 0.0}, transport=transport, coalesce=coalesce
    )


class SleepsFirst:
    """Runs every snippet after a 3 s sleep (past the sandbox's limit): a real timeout in the real sandbox, for every
    snippet, so which ones time out does not depend on timing."""

    def __init__(self, inner):
        self.inner = inner

    def session(self):
        return self.inner.session()

    def run_many(self, pairs):
        return self.inner.run_many([(session, "import time\ntime.sleep(3)\n" + code) for session, code in pairs])


@pytest.mark.parametrize("snippet_timeout", [False, True], ids=["ok", "snippet-timeout"])
def test_async_rollout_equals_barrier(server, server_trainer, tokenizer, snippet_timeout):
    from retool_trl.rollout.per_completion import async_rollout

    spec = RolloutSpec(max_completion_length=64, eos_token_ids=[tokenizer.eos_token_id], max_tool_calls=2)
    prompts = prompt_ids_of(tokenizer, n=12, seed=4)
    # A snippet timeout ends as today: the snippet's error goes back to the model, the row goes on.
    with LocalSandbox(num_workers=2, timeout_s=0.5 if snippet_timeout else 10.0) as inner:
        box = SleepsFirst(inner) if snippet_timeout else inner
        barrier = greedy_vllm_rollout(server_trainer.vllm_generation, tokenizer, box, prompts, spec)
        ours = async_rollout(prompts, greedy_engine(server, tokenizer), box, tokenizer, spec, max_concurrency=8)
    assert_same_rollout(ours, barrier, snippet_timeout)


def test_coalesced_requests_equal_one_request_per_turn(server, tokenizer, sandbox):
    """On vLLM's own server, the turns ready at once sent as one streamed request with a list of prompts give the
    completions of one plain request per turn (ids, masks, log-probs, reward kwargs) from fewer requests."""
    from retool_trl.rollout.per_completion import async_rollout

    spec = RolloutSpec(max_completion_length=64, eos_token_ids=[tokenizer.eos_token_id], max_tool_calls=2)
    prompts = prompt_ids_of(tokenizer, n=12, seed=4)
    alone_engine, engine = greedy_engine(server, tokenizer, coalesce=False), greedy_engine(server, tokenizer)
    alone = async_rollout(prompts, alone_engine, sandbox, tokenizer, spec, max_concurrency=8)
    ours = async_rollout(prompts, engine, sandbox, tokenizer, spec, max_concurrency=8)
    assert not any(alone.infra_failed)
    assert_same_rollout(ours, alone, snippet_timeout=False)
    turns = sum(alone.num_tool_calls) + len(prompts)
    assert alone_engine.requests == turns and engine.requests < turns


@pytest.mark.parametrize("coalesce", [False, True], ids=["request-per-turn", "coalesced"])
def test_async_rollout_dropped_connection_is_infrastructure(server, tokenizer, coalesce):
    """The connection is gone for good after some requests: the rows it cuts off are infrastructure failures. One
    request per turn: after 8 requests (some rows done by then). Coalesced: after the first request (the first three
    rows' first turns), so the rows that start later all fail."""
    import httpx

    from retool_trl.rewards.functions import boxed_accuracy
    from retool_trl.rollout.per_completion import async_rollout
    from retool_trl.testing import FakeSandbox

    class DropsAfter(httpx.AsyncHTTPTransport):
        """Forwards the first `n` requests (after the model-name lookup), then the connection is gone for good."""

        def __init__(self, n):
            super().__init__()
            self.left = n + 1

        async def handle_async_request(self, request):
            self.left -= 1
            if self.left < 0:
                raise httpx.ConnectError("connection dropped", request=request)
            return await super().handle_async_request(request)

    spec = RolloutSpec(max_completion_length=64, eos_token_ids=[tokenizer.eos_token_id], max_tool_calls=2)
    dataset = quickstart_dataset(6, seed=5)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in dataset["prompt"]]
    fake = FakeSandbox()
    engine = greedy_engine(server, tokenizer, DropsAfter(1 if coalesce else 8), coalesce=coalesce)
    result = async_rollout(prompts, engine, fake, tokenizer, spec, max_concurrency=3)
    # Rows cut off by the engine are infrastructure failures: unscored (None), never -1; the rest are scored.
    assert any(result.infra_failed) and (coalesce or not all(result.infra_failed))
    if coalesce:
        assert all(result.infra_failed[3:])
    rewards = boxed_accuracy(
        [""] * 6, dataset["answer"], model_text=result.model_text, infra_failed=result.infra_failed
    )
    assert [r is None for r in rewards] == result.infra_failed
    assert fake.sessions and all(s.closed for s in fake.sessions)


def test_trainer_async_mode_through_trl_generate(server_trainer):
    assert server_trainer.args.rollout_mode == "async"
    server_trainer._last_loaded_step = server_trainer.state.global_step  # no weight sync (needs NCCL)
    server_trainer.model.train()
    _, completion_ids, tool_mask, _, logprobs, extra, *_ = server_trainer._generate(
        list(quickstart_dataset(8, seed=6)["prompt"])
    )
    assert [len(m) for m in tool_mask] == [len(c) for c in completion_ids] == [len(lp) for lp in logprobs]
    assert len(extra["num_tool_calls"]) == 8 and not any(extra["infra_failed"])


def test_colocate_async_trains_with_lora(tmp_path, tokenizer, sandbox):
    """The single-GPU LoRA setup (colocated vLLM, async rollout by default): two steps train through the async loop,
    and TRL's weight sync (LoRA merged into the base weights) reaches the engine the loop drives."""
    from peft import LoraConfig

    args = engine_config(tmp_path, use_vllm=True, vllm_mode="colocate", learning_rate=1e-3, beta=0.0)
    assert args.rollout_mode == "async"
    trainer = ReToolTrainer(
        model_path(),
        args=args,
        train_dataset=quickstart_dataset(16),
        processing_class=tokenizer,
        sandbox=sandbox,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and trainer.state.global_step == 2
    for entry in logs:
        assert torch.isfinite(torch.tensor(entry["loss"]))
        # The async loop ran: one engine request per turn of each of the 8 completions (the barrier makes one call
        # per turn of the batch).
        assert entry["retool/engine_calls_per_rollout"] == pytest.approx(entry["retool/turns_per_completion"] * 8)
        assert entry["sampling/sampling_logp_difference/mean"] < 0.05
    # The engine follows the adapted policy: move the adapter far, sync as TRL does at the next step, compare.
    helper, model = trainer.vllm_generation, trainer.model
    ids = tokenizer("What is 12*34?\n<code>print(12*34)</code>", add_special_tokens=False)["input_ids"]
    before = policy_logprobs(model, ids)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    after = policy_logprobs(model, ids)
    assert (after - before).abs().mean().item() > 0.3
    helper.sync_weights()
    spec = RolloutSpec(max_completion_length=64, eos_token_ids=[tokenizer.eos_token_id], max_tool_calls=2)
    engine = vllm_prompt_logprobs(helper.llm, ids)
    # Far-off logits round differently in vLLM's CPU kernels: "follows" = much closer to the new policy than the old.
    to_after, to_before = (engine - after).abs().mean().item(), (engine - before).abs().mean().item()
    assert to_after < 0.1 and to_after < to_before / 4, (to_after, to_before)
    # ...and the async loop samples from it (temperature 1): its sampling log-probs are the adapted policy's.
    from retool_trl.rollout.engines.vllm_colocate import ColocateEngine
    from retool_trl.rollout.per_completion import async_rollout

    prompts = prompt_ids_of(tokenizer, n=4, seed=7)
    result = async_rollout(prompts, ColocateEngine(helper, tokenizer, "</code>"), sandbox, tokenizer, spec)
    row, prompt = result.completion_ids[0], prompts[0]
    policy = policy_logprobs(model, prompt + row)[len(prompt) - 1 :]
    sampled = torch.tensor(result.logprobs[0])
    mask = torch.tensor(result.interpreter_mask[0], dtype=torch.bool)
    assert (sampled[mask] - policy[mask]).abs().mean().item() < 0.1


# ------------------------------------------------------------------------------- a server with a small context
SMALL_CONTEXT = 128


@pytest.fixture(scope="module")
def small_context_server():
    server = VLLMServer(model_path(), max_model_len=SMALL_CONTEXT)
    yield server
    server.stop()


def test_rows_of_different_context_fit_a_server_with_a_small_max_model_len(
    small_context_server, tokenizer, sandbox, tmp_path
):
    """A server started with `--max_model_len 128` (TRL's advice: close to prompt + completion) and
    `max_completion_length` 64; one row's prompt leaves it 6 tokens of context, the others plenty. vLLM refuses a
    request whose one `max_tokens` does not fit every prompt (before: HTTP 400, the run stopped, in both loops). Now,
    through TRL's `_generate` in both loops, every row gets the budget that fits it: the long row is cut at the
    context limit and ends truncated (no EOS), the short rows finish as they would alone."""
    limit, room = SMALL_CONTEXT, 6
    server = small_context_server
    args = engine_config(
        tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=server.base_url, max_completion_length=64
    )
    original = VLLMClient.init_communicator
    VLLMClient.init_communicator = lambda self, device=None: None  # NCCL needs CUDA; no weight sync here
    try:
        trainer = ReToolTrainer(
            model_path(),
            args=args,
            train_dataset=quickstart_dataset(16),
            processing_class=tokenizer,
            sandbox=sandbox,
        )
    finally:
        VLLMClient.init_communicator = original
    trainer.vllm_generation.temperature = 0.0
    trainer._last_loaded_step = trainer.state.global_step
    trainer.model.train()
    texts = list(quickstart_dataset(4, seed=3)["prompt"])
    short = len(tokenizer(texts[0], add_special_tokens=False)["input_ids"])
    assert short + 64 <= limit  # the short rows fit with their whole budget
    filler = limit - room - len(tokenizer(texts[3], add_special_tokens=False)["input_ids"])
    texts[3] = " " * filler + texts[3]
    for mode in ("barrier", "async"):
        trainer.args.rollout_mode = mode
        prompt_ids, completion_ids, *_ = trainer._generate(texts)
        assert len(prompt_ids[3]) == limit - room, mode
        assert len(completion_ids[3]) == room and completion_ids[3][-1] != tokenizer.eos_token_id, mode
        for prompt, completion in zip(prompt_ids[:3], completion_ids[:3], strict=True):
            assert len(prompt) + len(completion) <= limit and completion[-1] == tokenizer.eos_token_id, mode


class PaddedOutputs:
    """A sandbox whose outputs end with 0-8 spaces, by the code's hash: after its first turn every row has a context
    of its own length, as completions of different lengths have in a real GRPO batch."""

    def __init__(self):
        from retool_trl.testing import FakeSandbox

        self.inner = FakeSandbox()

    def session(self):
        return self.inner.session()

    def run_many(self, pairs):
        import zlib

        from retool_trl.sandbox import ExecResult

        pairs = list(pairs)
        results = self.inner.run_many(pairs)
        return [
            ExecResult(r.output.rstrip("\n") + " " * (zlib.crc32(code.encode()) % 9) + "\n", r.ok, False, 0.0)
            for (_, code), r in zip(pairs, results, strict=True)
        ]

    def close(self):
        pass


def test_barrier_turns_on_a_server_sized_as_trl_advises_need_few_concurrent_requests(
    small_context_server, tokenizer, sandbox, monkeypatch, tmp_path
):
    """A real vLLM server started with `--max_model_len` sized as TRL advises (longest prompt + completion: 128),
    16 rows of problems of different prompt lengths that call code (the quickstart model), through TRL's server-mode
    helper in the barrier loop. After the first turn every row has its own context. Before, a turn sent one request
    per distinct `limit - length` (about one per row), one after the other; now the rows go as the async engine
    sends them, in fewer requests (counted per turn against the old rule), sent at once; every request fits, and
    the completions are the async loop's (greedy).

    "At once" is checked without timing (a short request may end before a loaded machine starts the next thread):
    each request of a group waits at a barrier sized to the group's requests before it is posted, so requests sent
    one after the other break the barrier and are counted."""
    import threading

    from retool_trl.rollout.per_completion import async_rollout
    from retool_trl.rollout.turns import fitting_parts

    server, limit, padded = small_context_server, SMALL_CONTEXT, PaddedOutputs()
    texts = list(quickstart_dataset(16, seed=5)["prompt"])
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    completion = limit - max(len(p) for p in prompts)
    assert len({len(p) for p in prompts}) > 1
    spec = RolloutSpec(
        max_completion_length=completion, eos_token_ids=[tokenizer.eos_token_id], max_tool_calls=2, max_model_len=limit
    )
    args = engine_config(
        tmp_path,
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server.base_url,
        max_completion_length=completion,
    )
    monkeypatch.setattr(VLLMClient, "init_communicator", lambda self, device=None: None)
    trainer = ReToolTrainer(
        model_path(), args=args, train_dataset=quickstart_dataset(16), processing_class=tokenizer, sandbox=sandbox
    )
    helper = trainer.vllm_generation
    helper.temperature = 0.0
    turn, turns, sent, lock = [0], [], [], threading.Lock()
    gates, arrived, not_at_once = [], [0], []  # this turn's barriers (one per group with requests), requests seen
    post, generate_turn = VLLMClient._post, VLLMBackend.generate_turn

    def group_requests(lengths, budgets, stops):
        # The requests the engine should send per group this turn: rows that may call code and rows that may not
        # go in separate calls, one after the other (code-calling rows first).
        counts = []
        for stop in (True, False):
            rows = [i for i, s in enumerate(stops) if s == stop]
            if rows:
                counts.append(len(fitting_parts([lengths[i] for i in rows], [budgets[i] for i in rows], limit)))
        return counts

    def recording_post(self, url, **kwargs):
        with lock:
            k, index = turn[0], arrived[0]
            arrived[0] += 1
            gate = None
            for barrier in gates:  # the groups' requests arrive in order: the first `parties` are the first group's
                if index < barrier.parties:
                    gate = barrier
                    break
                index -= barrier.parties
        if gate is not None and gate.parties > 1:
            try:
                gate.wait(timeout=20)
            except threading.BrokenBarrierError:
                with lock:
                    not_at_once.append(k)
        reply = post(self, url, **kwargs)
        with lock:
            sent.append((k, kwargs["json"]))
        return reply

    def counting_turn(self, sequences, max_new_tokens, stop_at_code_end):
        turn[0] += 1
        turns.append(([len(s) for s in sequences], list(max_new_tokens), [bool(s) for s in stop_at_code_end]))
        with lock:
            arrived[0] = 0
            gates[:] = [threading.Barrier(n) for n in group_requests(*turns[-1])]
        return generate_turn(self, sequences, max_new_tokens, stop_at_code_end)

    monkeypatch.setattr(VLLMClient, "_post", recording_post)
    monkeypatch.setattr(VLLMBackend, "generate_turn", counting_turn)
    backend = VLLMBackend(helper, tokenizer, "</code>", max_model_len=limit)
    barrier = interleaved_rollout(prompts, backend, padded, tokenizer, spec)
    engine = CompletionsEngine(server.base_url, tokenizer, "</code>", sampling={"temperature": 0.0})
    ours = async_rollout(prompts, engine, padded, tokenizer, spec, max_concurrency=16)
    assert_same_rollout(ours, barrier, snippet_timeout=False)
    assert len(turns) >= 2
    fewer = False
    for k, (lengths, budgets, stops) in enumerate(turns, start=1):
        requests = [body for t, body in sent if t == k]
        for body in requests:
            assert all(len(p) + body["max_tokens"] <= limit for p in body["prompt"])
        expected, old = sum(group_requests(lengths, budgets, stops)), 0
        for stop in (True, False):
            rows = [i for i, s in enumerate(stops) if s == stop]
            if rows:  # the old rule: one request per distinct budget the context leaves beside the group's largest
                largest = max(budgets[i] for i in rows)
                old += len({min(largest, limit - lengths[i]) for i in rows})
        assert len(requests) == expected <= old, (k, len(requests), old)
        fewer |= len(requests) < old
    assert fewer
    assert not not_at_once, f"turns whose requests were not all in flight together: {sorted(set(not_at_once))}"
