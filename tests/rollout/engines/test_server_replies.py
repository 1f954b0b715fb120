"""What the vLLM server hands back, read the same way by both rollout loops: NaN log-probs, stop token ids, aborted and
refused requests."""

from __future__ import annotations

import math

import pytest

from helpers.scripted_turns import EOS, TOKENIZER, Script, ids_of
from helpers.server_loops import run_loop
from helpers.vllm_like_server import VLLMLikeServer
from retool_trl.rollout.batched import RolloutSpec
from retool_trl.rollout.per_completion import CompletionsEngine, EngineRequestError, async_rollout
from retool_trl.rollout.turns import finish_turn
from retool_trl.testing import FakeSandbox

# ------------------------------------------------------------------------ budgets that fit each row's context
LONG = "Q" * 30 + ":"  # 31 prompt tokens


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
