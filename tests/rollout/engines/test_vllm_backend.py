"""The vLLM turn backend, driven by a fake with the interface of TRL's vLLM helper (no vLLM needed)."""

import importlib.util

import pytest
import torch
from datasets import Dataset

from helpers.testing_utils import (
    FakeSandbox,
    FakeVLLMGeneration,
    assert_rollout_invariants,
    make_bpe_tokenizer,
    make_char_tokenizer,
)
from retool_trl import ReToolConfig
from retool_trl.rollout import RolloutSpec, interleaved_rollout
from retool_trl.rollout.engines.vllm_batched import VLLMBackend, first_stop

SCRIPTS = [
    "A<code>x = 5\nprint(x * 2)</code>B<code>print(x)</code>C \\boxed{5}",
    "plain \\boxed{1}",
    "D<code>print('∑')</code>E",
]


@pytest.fixture(scope="module", params=["char", "bpe"])
def tokenizer(request):
    return make_char_tokenizer(extra_chars="∑") if request.param == "char" else make_bpe_tokenizer(vocab_size=400)


def rollout(tokenizer, overshoot=False, max_len=300, **spec):
    fake = FakeVLLMGeneration(tokenizer, SCRIPTS, overshoot=overshoot)
    backend = VLLMBackend(fake, tokenizer, "</code>")
    prompts = [tokenizer("Q:", add_special_tokens=False)["input_ids"] for _ in SCRIPTS]
    spec = RolloutSpec(max_completion_length=max_len, eos_token_ids=[tokenizer.eos_token_id], **spec)
    return interleaved_rollout(prompts, backend, FakeSandbox(), tokenizer, spec), fake


@pytest.mark.parametrize("overshoot", [False, True])
def test_masks_lengths_and_logprob_alignment(tokenizer, overshoot):
    result, fake = rollout(tokenizer, overshoot=overshoot)
    assert_rollout_invariants(result, tokenizer, SCRIPTS, 300)
    assert result.num_tool_calls == [2, 0, 1]
    for ids, mask, logprobs in zip(result.completion_ids, result.interpreter_mask, result.logprobs):
        for token, m, lp in zip(ids, mask, logprobs):
            # Sampled tokens carry their own sampling logprob; interpreter tokens a placeholder (masked anyway).
            assert lp == (-token / 1000 if m else 0.0)


def test_continuations_and_limits(tokenizer):
    result, fake = rollout(tokenizer, max_tool_calls=1)
    assert result.num_tool_calls == [1, 0, 1]
    # Turn 1: all three sequences; turn 2: the two that called code, which have no calls left: no stop string.
    assert [r["n"] for r in fake.requests] == [3, 2]
    assert [r["stop"] for r in fake.requests] == [["</code>"], []]
    # Budgets: each continuation asks for at most what is left of max_completion_length.
    assert fake.requests[0]["max_tokens"] == 300 and fake.requests[1]["max_tokens"] < 300
    assert fake.generation_kwargs == {} and fake.max_completion_length == 10_000  # restored


def test_length_budget_counts_interpreter_tokens(tokenizer):
    result, _ = rollout(tokenizer, max_len=12)
    assert all(len(ids) <= 12 for ids in result.completion_ids)
    assert_rollout_invariants(result, tokenizer, SCRIPTS, 12)


def test_first_stop_finds_the_token_completing_the_tag():
    tokenizer = make_char_tokenizer()
    ids = tokenizer("ab</code>cd", add_special_tokens=False)["input_ids"]
    assert first_stop(ids, tokenizer, "</code>") == 3
    assert first_stop(ids[:2], tokenizer, "</code>") is None


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_config_names_the_extra_when_vllm_is_missing(tmp_path):
    with pytest.raises(ValueError, match=r"retool-trl\[vllm\]"):
        ReToolConfig(output_dir=str(tmp_path), use_vllm=True, report_to="none")


def test_trainer_uses_trl_vllm_helper_and_importance_sampling(tmp_path):
    from helpers.testing_utils import save_tiny_model
    from retool_trl import ReToolTrainer

    tokenizer = make_char_tokenizer(extra_chars="∑")
    args = ReToolConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=3,
        num_generations=3,
        max_completion_length=64,
        report_to="none",
        bf16=False,
        use_cpu=True,
        rollout_mode="barrier",  # TRL's helper, batched per turn (colocate async drives the engine itself)
    )
    trainer = ReToolTrainer(
        save_tiny_model(tmp_path / "m", tokenizer),
        reward_funcs=lambda completions, **k: [0.0, 1.0, 2.0],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "Q:"}] * 3),
        processing_class=tokenizer,
        sandbox=FakeSandbox(),
    )
    # Turn vLLM on after construction (vLLM is not installed here): TRL's own `_generate` path is then taken.
    trainer.use_vllm, trainer.vllm_generation = True, FakeVLLMGeneration(tokenizer, SCRIPTS)
    trainer._last_loaded_step = 0
    trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode = "token_truncate"  # per-token ratios, to look at each position
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = trainer._generate_and_score_completions([{"prompt": "Q:"}] * 3)
    assert inputs["tool_mask"].shape == inputs["completion_ids"].shape
    assert (inputs["tool_mask"] == 0).any()
    tool_mask, ids = inputs["tool_mask"].bool(), inputs["completion_ids"]
    real = inputs["completion_mask"].bool()
    sampling = inputs["sampling_per_token_logps"]
    # vLLM's sampling logprobs line up with the tokens TRL scores...
    assert torch.allclose(sampling[tool_mask & real], -ids[tool_mask & real].float() / 1000)
    # ...and interpreter tokens never enter the importance-sampling correction (ratio exactly 1).
    ratio = inputs["importance_sampling_ratio"]
    assert ratio.shape == ids.shape and torch.all(ratio[~tool_mask & real] == 1.0)


def test_stop_is_per_row_so_rows_without_calls_left_cost_no_extra_engine_call():
    from retool_trl.training.metrics import rollout_metrics

    tokenizer = make_char_tokenizer()
    scripts = [
        "<code>print(1)</code>a<code>print(2)</code>b<code>print(3)</code>c \\boxed{3}",
        "<code>print(4)</code>d",
    ]
    fake = FakeVLLMGeneration(tokenizer, scripts)
    backend = VLLMBackend(fake, tokenizer, "</code>")
    prompts = [tokenizer("Q:", add_special_tokens=False)["input_ids"] for _ in scripts]
    spec = RolloutSpec(max_completion_length=300, eos_token_ids=[tokenizer.eos_token_id], max_tool_calls=1)
    result = interleaved_rollout(prompts, backend, FakeSandbox(), tokenizer, spec)
    assert_rollout_invariants(result, tokenizer, scripts, 300)
    assert result.num_tool_calls == [1, 1]
    # Turn 2: neither row may call code any more, so neither stops at the two `</code>` left in the first script:
    # one call runs both to the end (stopping every row made one call per remaining `</code>`: 4 calls in all).
    assert [(r["n"], r["stop"]) for r in fake.requests] == [(2, ["</code>"]), (2, [])]
    assert result.engine_calls == [2, 2]
    assert rollout_metrics(result, lambda t: t)["retool/engine_calls_per_rollout"] == 2.0


def test_rows_with_and_without_calls_left_go_to_separate_requests():
    tokenizer = make_char_tokenizer()
    # Row 1 first writes a stray `</code>` (no open block: no call), so in turn 2 only row 1 may still call code.
    scripts = ["<code>print(1)</code>a<code>print(2)</code>b", "x</code>y<code>print(4)</code>z<code>print(5)</code>w"]
    fake = FakeVLLMGeneration(tokenizer, scripts)
    prompts = [tokenizer("Q:", add_special_tokens=False)["input_ids"] for _ in scripts]
    spec = RolloutSpec(max_completion_length=300, eos_token_ids=[tokenizer.eos_token_id], max_tool_calls=1)
    result = interleaved_rollout(prompts, VLLMBackend(fake, tokenizer, "</code>"), FakeSandbox(), tokenizer, spec)
    assert_rollout_invariants(result, tokenizer, scripts, 300)
    assert result.num_tool_calls == [1, 1]
    stop, free = ["</code>"], []
    assert [(r["n"], r["stop"]) for r in fake.requests] == [(2, stop), (1, stop), (1, free), (1, free)]
    assert result.engine_calls == [4, 4]
