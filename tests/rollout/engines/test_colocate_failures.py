"""A colocated vLLM engine that drops or refuses a request fails the turn with one clear error instead of hanging."""

from __future__ import annotations

import types

import pytest

from helpers.scripted_turns import EOS, TOKENIZER, ids_of
from retool_trl.rollout.batched import RolloutSpec
from retool_trl.rollout.per_completion import EngineRequestError, async_rollout
from retool_trl.testing import FakeSandbox


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
