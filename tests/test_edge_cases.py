"""Edge cases found in review: broken sessions on retry, special tokens, empty turns, cache fallbacks, sleep mode."""

import pytest
import torch
from transformers import GenerationConfig

from retool_trl import ReToolConfig
from retool_trl.evaluation.inference import eos_token_ids_of
from retool_trl.rewards.functions import boxed_accuracy
from retool_trl.rollout import RolloutSpec, interleaved_rollout
from retool_trl.rollout.engines.transformers_generate import TransformersBackend
from retool_trl.rollout.engines.vllm_batched import VLLMBackend
from retool_trl.rollout.types import TurnOutput
from retool_trl.sandbox import ExecResult
from testing_utils import (
    FakeSandbox,
    FakeVLLMGeneration,
    ScriptedBackend,
    make_char_tokenizer,
    make_tiny_qwen2,
    record_rewards,
    trainer_for,
)

TOKENIZER = make_char_tokenizer()


def rollout(scripts, sandbox=None, tokenizer=TOKENIZER, **spec):
    prompts = [tokenizer("Q:", add_special_tokens=False)["input_ids"] for _ in scripts]
    spec = RolloutSpec(max_completion_length=200, eos_token_ids=[tokenizer.eos_token_id], **spec)
    return interleaved_rollout(prompts, ScriptedBackend(tokenizer, scripts), sandbox or FakeSandbox(), tokenizer, spec)


class BreakingSandbox(FakeSandbox):
    """Like LocalSandbox: an infrastructure failure breaks the session for good (later calls say so)."""

    def __init__(self):
        super().__init__()
        self.fail_next = False
        self.broken = set()

    def run_many(self, pairs):
        results = []
        for session, code in pairs:
            if id(session) in self.broken:
                results.append(ExecResult("SessionError: session was reset", False, False, 0.0))
            elif self.fail_next and "y" in code:
                self.fail_next = False
                self.broken.add(id(session))
                results.append(ExecResult("SandboxError: worker lost", False, False, 0.0, infra_error=True))
            else:
                results.extend(super().run_many([(session, code)]))
        return results


def test_retry_uses_a_fresh_session_with_the_earlier_cells_replayed():
    sandbox = BreakingSandbox()
    sandbox.fail_next = True
    result = rollout(["<code>x = 40</code>a<code>y = x + 2\nprint(y)</code>\\boxed{42}"], sandbox=sandbox)
    env = TOKENIZER.decode([t for t, m in zip(result.completion_ids[0], result.interpreter_mask[0]) if not m])
    assert env.endswith("<interpreter>42\n</interpreter>")  # state of cell 1 was restored in the new session
    assert result.infra_failed == [False] and result.num_tool_errors == [0]


class PartlyDownSandbox(FakeSandbox):
    """Fails the cells that print 1 or 2 for its own reasons; runs the others (a step that fails every call stops
    the run instead: tests/test_no_silent_failure.py)."""

    def run_many(self, pairs):
        return [
            ExecResult("SandboxError: service down", False, False, 0.0, infra_error=True)
            if code in ("print(1)", "print(2)")
            else super(PartlyDownSandbox, self).run_many([(session, code)])[0]
            for session, code in pairs
        ]


@pytest.mark.parametrize("drop", [True, False])
def test_infra_failures_are_unscored_by_every_reward_function(tmp_path, drop):
    scripts = [
        "<code>print(1)</code>\\boxed{42}",
        "<code>print(3)</code>\\boxed{41}",
        "\\boxed{42}",
        "<code>print(2)</code>\\boxed{40}",
    ]
    trainer = trainer_for(tmp_path, scripts, PartlyDownSandbox(), tool_use_bonus=0.1, drop_infra_failures=drop)
    seen = record_rewards(trainer)
    inputs = trainer._generate_and_score_completions([{"prompt": "Q:", "answer": "42"} for _ in range(4)])
    failed_rows = seen["rewards"][[0, 3]]
    if drop:
        assert torch.isnan(failed_rows).all()  # boxed_accuracy and tool_use_shaping alike
        assert inputs["advantages"][[0, 3]].tolist() == [0.0, 0.0]
    else:  # scored as the model's own mistakes
        assert seen["rewards"][0, 0].item() == 1.0 and seen["rewards"][3, 0].item() == -1.0


def test_special_token_text_printed_by_code_stays_text():
    eos_text = TOKENIZER.eos_token
    result = rollout([f"<code>print('{eos_text}')</code>\\boxed{{1}}"])
    env_ids = [t for t, m in zip(result.completion_ids[0], result.interpreter_mask[0]) if not m]
    assert TOKENIZER.eos_token_id not in env_ids
    assert eos_text in TOKENIZER.decode(env_ids)


def test_tags_registered_as_special_tokens_still_hide_answers_in_code():
    tokenizer = make_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<code>", "</code>"]})
    script = "<code># the answer is \\boxed{42}\nprint(1)</code>done"
    result = rollout([script], tokenizer=tokenizer)
    assert result.model_text == [script]
    assert boxed_accuracy([""], ["42"], model_text=result.model_text) == [-1.0]


def test_empty_first_turn_gives_a_completion_trl_can_read():
    class Silent:
        def generate_turn(self, sequences, max_new_tokens, stop_at_code_end):
            return [TurnOutput([]) for _ in sequences]

    spec = RolloutSpec(max_completion_length=10, eos_token_ids=[TOKENIZER.eos_token_id])
    result = interleaved_rollout([[5, 6]], Silent(), FakeSandbox(), TOKENIZER, spec)
    assert result.completion_ids == [[TOKENIZER.eos_token_id]] and result.interpreter_mask == [[0]]


def backend(model, reuse=True, **config):
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=30,
        eos_token_id=[TOKENIZER.eos_token_id],
        pad_token_id=TOKENIZER.pad_token_id,
        **config,
    )
    return TransformersBackend(model, TOKENIZER, config, "</code>", [TOKENIZER.eos_token_id], reuse_cache=reuse)


def test_cache_is_really_reused_on_the_next_turn():
    model = make_tiny_qwen2(TOKENIZER).eval()
    b = backend(model)
    first = b.generate_turn([[5, 6, 7], [8, 9]], [4, 4], [False, False])
    kept = b._cache
    assert kept is not None
    seqs = [[5, 6, 7, *first[0].token_ids, 10, 11], [8, 9, *first[1].token_ids]]
    ids, mask, cache = b._batch(seqs, "cpu")
    assert cache is kept  # continued from the kept cache, not a fresh prefill
    # The row without new tokens is fed its last token again (its earlier copy hidden), so the next token is
    # sampled from that token's state, never from a masked hole.
    assert mask[1, -2:].tolist() == [0, 1] and ids[1, -1].item() == seqs[1][-1]
    assert mask.sum(dim=1).tolist() == [len(s) for s in seqs]


@pytest.mark.parametrize("config", [{"cache_implementation": "static"}, {"repetition_penalty": 1.3}])
def test_cache_reuse_falls_back_where_holes_are_not_exact(config):
    model = make_tiny_qwen2(TOKENIZER).eval()
    b = backend(model, **config)
    outs = b.generate_turn([[5, 6, 7], [8, 9]], [4, 4], [False, False])
    assert b._cache is None  # no reuse: the next turn prefills afresh
    b.generate_turn([[5, 6, 7, *outs[0].token_ids, 10]], [3], [False])  # and does not crash


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


def test_eval_stops_at_the_models_end_of_turn_ids():
    model = make_tiny_qwen2(TOKENIZER)
    model.generation_config.eos_token_id = [TOKENIZER.eos_token_id, 7]
    assert eos_token_ids_of(model, TOKENIZER) == [TOKENIZER.eos_token_id, 7]


def test_config_rejects_beams_typo_prompts_and_unbounded_length(tmp_path):
    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="num_beams"):
        ReToolConfig(**base, generation_kwargs={"num_beams": 2})
    with pytest.raises(ValueError, match="system_prompt"):
        ReToolConfig(**base, system_prompt="retool_consise")
    with pytest.raises(ValueError, match="max_completion_length"):
        ReToolConfig(**base, max_completion_length=None)
    assert ReToolConfig(**base, system_prompt="Think, then use code.").resolved_system_prompt.startswith("Think")
