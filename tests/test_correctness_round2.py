"""Correctness where users run, round 2: budgets that fit the context, log-probs TRL hands as `None`, stop token ids,
aborted and refused requests, the colocated engine's liveness, the server host on several nodes, TRL's `bf16` default.

Server-side tests run against `VLLMLikeServer` (a real HTTP server applying vLLM's own request checks) and, in the
barrier loop, through TRL's real `VLLMClient` and `VLLMGeneration.generate`. Each test failed on the code before its
fix.
"""

from __future__ import annotations

import math
import types

import httpx
import pytest
import torch
from test_turn_engines import EOS, TOKENIZER, Script, ids_of
from vllm_like_server import VLLMLikeServer

from retool_trl import ReToolConfig
from retool_trl.rollout import RolloutSpec, interleaved_rollout
from retool_trl.rollout.engines.vllm_batched import VLLMBackend
from retool_trl.rollout.per_completion import CompletionsEngine, EngineRequestError, async_rollout
from retool_trl.rollout.turns import finish_turn
from retool_trl.testing import FakeSandbox
from testing_utils import trl_server_generation


def trl_server_helper(url, monkeypatch, generation_kwargs=None):
    """TRL's own server-mode `VLLMGeneration.generate` with TRL's real `VLLMClient`, one training process."""
    from trl.generation import vllm_generation as trl_vllm
    from trl.generation.vllm_client import VLLMClient

    monkeypatch.setattr(trl_vllm, "gather_object", lambda xs: list(xs))
    monkeypatch.setattr(trl_vllm, "broadcast_object_list", lambda xs, from_process=0: xs)
    accelerator = types.SimpleNamespace(
        num_processes=1, process_index=0, is_main_process=True, device=torch.device("cpu")
    )
    # TRL's client, its `generate`, `_post` and log-prob parsing as they are; its HTTP session an httpx one (the same
    # `get`/`post` interface), since this environment has no `requests`.
    client = object.__new__(VLLMClient)
    client.__dict__.update(base_url=url, session=httpx.Client(timeout=30), communicator=None, _updating_weights=False)
    client.model = client._get(f"{url}/v1/models")["data"][0]["id"]
    helper = trl_server_generation(accelerator, client, generation_kwargs)
    return helper, accelerator


def max_model_len_of(url) -> int | None:
    """The context limit the trainer reads from the server (`ReToolTrainer._engine_max_model_len`)."""
    from retool_trl.trainer import ReToolTrainer

    view = types.SimpleNamespace(
        use_vllm=True,
        vllm_generation=types.SimpleNamespace(mode="server"),
        args=types.SimpleNamespace(vllm_server_base_url=url),
    )
    return ReToolTrainer._engine_max_model_len(view)


def run_loop(loop, server, prompts, spec, monkeypatch, generation_kwargs=None):
    if loop == "barrier":
        helper, accelerator = trl_server_helper(server.url, monkeypatch, generation_kwargs)
        backend = VLLMBackend(helper, TOKENIZER, "</code>", accelerator=accelerator, max_model_len=spec.max_model_len)
        return interleaved_rollout(prompts, backend, FakeSandbox(), TOKENIZER, spec)
    sampling = {"temperature": 1.0, **(generation_kwargs or {})}
    engine = CompletionsEngine(server.url, TOKENIZER, "</code>", sampling=sampling)  # model and limit from the server
    return async_rollout(prompts, engine, FakeSandbox(), TOKENIZER, spec)


# ------------------------------------------------------------------------ budgets that fit each row's context
LONG = "Q" * 30 + ":"  # 31 prompt tokens


@pytest.mark.parametrize("loop", ["barrier", "async"])
def test_rows_of_different_context_each_get_the_budget_that_fits(loop, monkeypatch):
    """A server started with a small `--max_model_len` (48, TRL's advice: close to prompt + completion), a batch with a
    short and a long prompt, `max_completion_length` 30. Each row alone fits (2 + 30, 31 + 17), together one request
    with max_tokens 30 does not (31 + 30 > 48) and vLLM refuses it whole (HTTP 400; before: the run stopped). Now
    every row gets the budget its context leaves; the long one fills the context and ends truncated (never a void
    turn followed by a prompt past the limit); a row that calls code continues within the context."""
    texts = ["<code>print(1)</code>so \\boxed{1}", "x" * 40 + " \\boxed{2}"]
    prompts = [ids_of("Q:"), ids_of(LONG)]
    scripts = {tuple(p): Script(p, t) for p, t in zip(prompts, texts, strict=True)}
    server = VLLMLikeServer(scripts, TOKENIZER, max_model_len=48)
    try:
        limit = max_model_len_of(server.url)
        assert limit == 48
        spec = RolloutSpec(max_completion_length=30, eos_token_ids=[EOS], max_tool_calls=2, max_model_len=limit)
        result = run_loop(loop, server, prompts, spec, monkeypatch)
    finally:
        server.close()
    assert not server.refused
    for body in server.bodies:  # every request fits every one of its prompts
        rows = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        assert all(len(p) + body["max_tokens"] <= 48 for p in rows)
    # The short row: its code ran and its answer is whole. The long row: cut at the context limit, truncated.
    assert result.num_tool_calls[0] == 1 and result.model_text[0].endswith("\\boxed{1}")
    assert result.completion_ids[0][-1] == EOS
    assert len(prompts[1]) + len(result.completion_ids[1]) == 48
    assert result.completion_ids[1][-1] != EOS and result.model_text[1] == "x" * 17
    assert result.num_void_turns == [0, 0] and result.num_turns[1] == 1 and not any(result.infra_failed)


def test_a_turn_cut_at_the_context_limit_after_code_ends_truncated():
    """prompt + max_completion_length > max_model_len: the context fills after an interpreter block. The completion
    ends truncated there (before: the turn was counted void and the next prompt passed the limit)."""
    from retool_trl.testing import ScriptedBackend

    prompt = ids_of("Q:")
    text = "<code>print(12345)</code>" + "y" * 50
    spec = RolloutSpec(max_completion_length=200, eos_token_ids=[EOS], max_tool_calls=2, max_model_len=60)
    asked = []

    class Recording(ScriptedBackend):
        def generate_turn(self, sequences, max_new_tokens, stop_at_code_end):
            asked.extend(len(s) + b for s, b in zip(sequences, max_new_tokens, strict=True))
            return super().generate_turn(sequences, max_new_tokens, stop_at_code_end)

    result = interleaved_rollout([prompt], Recording(TOKENIZER, [text]), FakeSandbox(), TOKENIZER, spec)
    assert max(asked) <= 60
    assert len(prompt) + len(result.completion_ids[0]) == 60
    assert result.num_tool_calls == [1] and result.num_void_turns == [0] and result.num_turns == [2]


# ----------------------------------------------------------------------------------- NaN log-probs (None)
def test_a_nan_logprob_that_trl_hands_as_none_is_nan_not_an_exception():
    """TRL's helpers turn a NaN log-prob into `None`; its trainer reads `None` as NaN. Before: `float(None)` raised
    mid-rollout."""
    out = finish_turn([5, 6, EOS], [-0.5, None, -0.1], TOKENIZER, "</code>", [], True, 10)
    assert out.logprobs[0] == -0.5 and math.isnan(out.logprobs[1]) and out.logprobs[2] == -0.1


@pytest.mark.parametrize("loop", ["barrier", "async"])
def test_a_nan_logprob_from_the_server_never_raises(loop, monkeypatch):
    """The server's reply has a NaN log-prob: TRL's client hands it as `None` (barrier); vLLM's streamed reply writes
    it as `null` (async). The rollout finishes, the log-prob is NaN (TRL keeps such tokens out of its correction)."""
    prompt = ids_of("Q:")
    server = VLLMLikeServer({tuple(prompt): Script(prompt, "ab \\boxed{1}")}, TOKENIZER, nan_logprob_at=1)
    spec = RolloutSpec(max_completion_length=30, eos_token_ids=[EOS], max_tool_calls=1)
    try:
        result = run_loop(loop, server, [prompt], spec, monkeypatch)
    finally:
        server.close()
    assert result.model_text == ["ab \\boxed{1}"] and math.isnan(result.logprobs[0][1])


# ---------------------------------------------------------------------------- stop token ids, min_tokens
@pytest.mark.parametrize("loop", ["barrier", "async"])
def test_stop_token_ids_end_the_completion(loop, monkeypatch):
    """`generation_kwargs={"stop_token_ids": [id of "#"]}`: vLLM stops the turn at that token; the completion ends
    there, as at EOS (before: the rollout asked for another turn, up to the budget)."""
    prompt = ids_of("Q:")
    server = VLLMLikeServer({tuple(prompt): Script(prompt, "ab#cd#ef")}, TOKENIZER)
    spec = RolloutSpec(max_completion_length=30, eos_token_ids=[EOS], max_tool_calls=1)
    try:
        result = run_loop(loop, server, [prompt], spec, monkeypatch, {"stop_token_ids": ids_of("#")})
    finally:
        server.close()
    assert result.model_text == ["ab#"] and result.num_turns == [1] and len(server.bodies) == 1


def test_min_tokens_is_refused_with_one_clear_line(tmp_path):
    """vLLM applies `min_tokens` to each request, i.e. each turn, not to the completion: refused, saying why."""
    with pytest.raises(ValueError, match=r"min_tokens.*each request") as error:
        ReToolConfig(output_dir=str(tmp_path), generation_kwargs={"min_tokens": 8}, report_to="none", use_cpu=True)
    assert "\n" not in str(error.value)


# --------------------------------------------------------------------------- aborted and refused requests
@pytest.mark.parametrize("coalesce", [True, False])
def test_an_aborted_request_is_an_engine_failure_not_a_finished_turn(coalesce):
    """vLLM answers `finish_reason: "abort"` for a request it gave up (engine failure, a reset under it): the turn did
    not finish, the completion is an engine failure (unscored), never a finished turn scored as the model's."""
    prompt = ids_of("Q:")
    server = VLLMLikeServer({tuple(prompt): Script(prompt, "ab \\boxed{1}")}, TOKENIZER)
    server.finish_reason = "abort"
    spec = RolloutSpec(max_completion_length=30, eos_token_ids=[EOS], max_tool_calls=1)
    try:
        engine = CompletionsEngine(server.url, TOKENIZER, "</code>", coalesce=coalesce)
        result = async_rollout([prompt], engine, FakeSandbox(), TOKENIZER, spec)
    finally:
        server.close()
    assert result.infra_failed == [True] and result.num_infra_errors == [1] and result.num_turns == [0]


def test_a_refused_request_names_the_servers_reason_on_one_line():
    """HTTP 400 from vLLM: one clear error with the server's own message (not its JSON), naming what to check."""
    prompt = ids_of(LONG)
    server = VLLMLikeServer({tuple(prompt): Script(prompt, "ab")}, TOKENIZER, max_model_len=40)
    spec = RolloutSpec(max_completion_length=30, eos_token_ids=[EOS], max_tool_calls=1)  # limit not given
    try:
        engine = CompletionsEngine(server.url, TOKENIZER, "</code>", model="policy")  # nor asked for
        with pytest.raises(EngineRequestError) as error:
            async_rollout([prompt], engine, FakeSandbox(), TOKENIZER, spec)
    finally:
        server.close()
    message = str(error.value)
    assert "HTTP 400" in message and "maximum context length is 40 tokens" in message and "max_model_len" in message
    assert "\n" not in message and '"error"' not in message


class DroppingEngine:
    """vLLM's `LLMEngine` interface (`add_request`, `step`, `has_unfinished_requests`, `abort_request`) for one
    request that the engine drops: it never finishes and the engine has nothing left to run."""

    def __init__(self, refuse=False):
        self.refuse, self.added = refuse, []

    def add_request(self, request_id, prompt, params):
        if self.refuse:  # vLLM's input processor
            raise ValueError("The decoder prompt (length 600) is longer than the maximum model length of 512.")
        self.added.append(request_id)

    def step(self):
        return []

    def has_unfinished_requests(self):
        return False

    def abort_request(self, ids):
        pass


def colocate_engine(engine):
    from retool_trl.rollout.engines.vllm_colocate import ColocateEngine

    helper = types.SimpleNamespace(
        mode="colocate",
        tensor_parallel_size=1,
        enable_sleep_mode=False,
        generation_kwargs={},
        llm=types.SimpleNamespace(llm_engine=engine),
    )
    colocate = ColocateEngine(helper, TOKENIZER, "</code>")
    colocate.sampling_params = lambda max_tokens, stop: None  # no vLLM here: the fake engine ignores the params
    return colocate


@pytest.mark.timeout(60)
def test_colocated_engine_that_drops_a_request_fails_the_turn_instead_of_hanging():
    """The colocated engine's driver loop checks liveness: a request the engine no longer runs fails its turn with a
    clear engine error (before: the turn waited forever and the run hung)."""
    engine = DroppingEngine()
    spec = RolloutSpec(max_completion_length=30, eos_token_ids=[EOS], max_tool_calls=1)
    result = async_rollout([ids_of("Q:")], colocate_engine(engine), FakeSandbox(), TOKENIZER, spec)
    assert engine.added and result.infra_failed == [True] and result.num_infra_errors == [1]


def test_colocated_engine_that_refuses_a_request_raises_one_clear_error():
    """vLLM's input checks raise a bare `ValueError` from `add_request`: one `EngineRequestError` naming the sizes."""
    spec = RolloutSpec(max_completion_length=30, eos_token_ids=[EOS], max_tool_calls=1)
    with pytest.raises(EngineRequestError, match=r"refused a request of 2 prompt tokens.*maximum model length"):
        async_rollout([ids_of("Q:")], colocate_engine(DroppingEngine(refuse=True)), FakeSandbox(), TOKENIZER, spec)


# ------------------------------------------------------------------------------------ several nodes, one server
def test_host_0000_connects_every_node_to_the_main_process_host(monkeypatch):
    """`vllm_server_host: 0.0.0.0` (TRL's default): the server listens on every interface of the main process's host.
    Processes on other nodes must connect there (the launcher's MASTER_ADDR), not to their own 127.0.0.1."""
    from retool_trl.trainer import _server_url

    args = types.SimpleNamespace(vllm_server_base_url=None, vllm_server_host="0.0.0.0", vllm_server_port=8000)
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    assert _server_url(args) == "http://10.1.2.3:8000"
    monkeypatch.delenv("MASTER_ADDR")
    assert _server_url(args) == "http://127.0.0.1:8000"  # no launcher: this host
    args.vllm_server_host = "10.9.9.9"
    assert _server_url(args) == "http://10.9.9.9:8000"


# ------------------------------------------------------------------------------------------- TRL's defaults
def test_without_code_training_is_grpotrainers_with_default_precision(tmp_path):
    """TRL's own GRPO tests run against `ReToolTrainer`: with `use_cpu=True` and `bf16` left unset, `GRPOConfig` trains
    in bf16 mixed precision; a ReTool run whose model writes no code must train exactly as `GRPOTrainer` (before:
    `ReToolConfig` chose fp32 there: largest parameter difference 0.029 here, 0.31 in the review's run)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from retool_trl import ReToolTrainer
    from testing_utils import make_char_tokenizer, save_tiny_model

    tokenizer = make_char_tokenizer()
    model = save_tiny_model(tmp_path / "model", tokenizer)
    dataset = Dataset.from_list([{"prompt": f"Q{i}: 1+{i}=?"} for i in range(4)])

    def reward(completions, **kwargs):
        return [float(len(c) % 3) for c in completions]

    common = dict(
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-2,
        report_to="none",
        use_cpu=True,
        seed=0,
        save_strategy="no",
        disable_tqdm=True,
    )
    assert GRPOConfig(str(tmp_path / "g"), **common).bf16 == ReToolConfig(str(tmp_path / "r"), **common).bf16
    params = []
    for trainer_class, config_class in ((GRPOTrainer, GRPOConfig), (ReToolTrainer, ReToolConfig)):
        trainer = trainer_class(
            model,
            reward_funcs=reward,
            args=config_class(str(tmp_path / trainer_class.__name__), **common),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        trainer.train()
        params.append({k: v.detach().clone() for k, v in trainer.model.named_parameters()})
    from transformers import AutoModelForCausalLM

    start = dict(AutoModelForCausalLM.from_pretrained(model).named_parameters())
    assert max((params[0][k] - start[k]).abs().max().item() for k in start) > 0  # training moved the weights
    differs = max((params[0][k] - params[1][k]).abs().max().item() for k in params[0])
    assert differs == 0.0, f"largest parameter difference {differs}"


# ------------------------------------------------------------------------------ prompts as documented, eval as trained
def test_eval_of_a_trained_model_builds_its_prompts_as_training_did(tmp_path, capsys):
    """The quickstart's recipe on the shipped tiny model: plain-text prompts, `system_prompt: none`. `retool-trl eval`
    of the saved model, with no prompt flag, scores as with the training's settings given by hand (before: the default
    system prompt was put in front of the plain prompts, and the quickstart's trained model scored 0%)."""
    import json

    from retool_trl import ReToolTrainer
    from retool_trl.cli import main
    from retool_trl.data.synthetic import make_arithmetic_dataset
    from retool_trl.models.tokenizers import load_tokenizer
    from retool_trl.quickstart import model_path
    from retool_trl.sandbox import LocalSandbox

    tokenizer = load_tokenizer(model_path())
    config = ReToolConfig(
        output_dir=str(tmp_path / "run"),
        system_prompt="none",
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=48,
        max_tool_calls=2,
        learning_rate=1e-6,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    with LocalSandbox(num_workers=1, timeout_s=5.0) as sandbox:
        trainer = ReToolTrainer(
            model_path(),
            args=config,
            train_dataset=make_arithmetic_dataset(8, seed=0),
            processing_class=tokenizer,
            sandbox=sandbox,
        )
        trainer.train()
        trainer.save_model(str(tmp_path / "model"))
    recorded = json.loads((tmp_path / "model" / "retool_prompt.json").read_text())
    assert recorded["system_prompt"] == "none" and recorded["prompt_format"] == "plain"

    def evaluate(name, *flags):
        out = tmp_path / name
        argv = ["eval", "--model", str(tmp_path / "model"), "--dataset", "synthetic", "--max_samples", "12"]
        argv += ["--max_completion_length", "48", "--sandbox_workers", "1", "--output_dir", str(out)]
        assert main([*argv, *flags]) == 0
        return json.loads((out / "results.json").read_text())["metrics"]["pass@1"]

    as_trained = evaluate("by_hand", "--system_prompt", "none", "--prompt_format", "plain")
    assert as_trained >= 0.5  # the shipped model solves these with its training prompts
    assert evaluate("no_flags") == as_trained
    assert "Prompt settings as in training" in capsys.readouterr().out
    # A setting given on the command line or in --config still wins over the recorded one.
    from retool_trl.cli.eval import given_options, parse_eval_args, take_trained_prompt_settings

    (tmp_path / "eval.yaml").write_text("code_start: '[PY]'\n")
    config_file = str(tmp_path / "eval.yaml")
    argv = ["--model", "m", "--dataset", "synthetic", "--system-prompt", "Be brief.", "--config", config_file]
    given = given_options(argv)
    assert {"system_prompt", "code_start", "model", "dataset"} <= given
    eval_args, config = parse_eval_args(["--model", "m", "--dataset", "synthetic", "--system_prompt", "Be brief."])
    taken = take_trained_prompt_settings(str(tmp_path / "model"), eval_args, config, {"system_prompt"})
    assert config.system_prompt == "Be brief." and "system_prompt" not in taken and eval_args.prompt_format == "plain"
