"""vLLM's sleep mode in colocate runs: weights are synced once per rollout."""

from helpers.testing_utils import (
    FakeSandbox,
    FakeVLLMGeneration,
    make_char_tokenizer,
)
from retool_trl.rollout.batched import RolloutSpec, interleaved_rollout
from retool_trl.rollout.engines.vllm_batched import VLLMBackend

TOKENIZER = make_char_tokenizer()


def test_vllm_sleep_mode_syncs_weights_once_per_rollout():
    class Engine:
        def __init__(self):
            self.calls = []

        def wake_up(self, tags):
            self.calls.append("wake")

        def sleep(self, level):
            self.calls.append("sleep")

    scripts = ["<code>print(1)</code>a<code>print(2)</code>b<code>print(3)</code>c"]
    fake = FakeVLLMGeneration(TOKENIZER, scripts)
    fake.mode, fake.enable_sleep_mode, fake._llm_weights_sleeping, fake.llm = "colocate", True, True, Engine()
    syncs = []
    fake.sync_weights = lambda: syncs.append(1)
    prompts = [TOKENIZER("Q:", add_special_tokens=False)["input_ids"]]
    spec = RolloutSpec(max_completion_length=200, eos_token_ids=[TOKENIZER.eos_token_id])
    result = interleaved_rollout(prompts, VLLMBackend(fake, TOKENIZER, "</code>"), FakeSandbox(), TOKENIZER, spec)
    assert result.num_tool_calls == [3] and len(fake.requests) == 4
    assert len(syncs) == 1 and fake.llm.calls == ["wake", "sleep"]
    assert fake.enable_sleep_mode and fake._llm_weights_sleeping
