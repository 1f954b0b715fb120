"""Training-stability options of ReToolConfig: void turns, infra failures, tool-use shaping, GRPO-RoC, truncation."""

import random

import pytest
import torch

from helpers.testing_utils import FakeSandbox, ScriptedBackend, make_char_tokenizer, record_rewards, trainer_for
from retool_trl import ReToolConfig
from retool_trl.rewards.functions import boxed_accuracy, tool_use_shaping
from retool_trl.rollout import RolloutSpec, interleaved_rollout
from retool_trl.sandbox import ExecResult
from retool_trl.training.stability import resample_on_correct

TOKENIZER = make_char_tokenizer()


def batch():
    return [{"prompt": "Q:", "answer": "42"} for _ in range(4)]  # distinct dicts, as a dataloader gives


def rollout(scripts, sandbox=None, **spec):
    prompts = [TOKENIZER("Q:", add_special_tokens=False)["input_ids"] for _ in scripts]
    spec = RolloutSpec(max_completion_length=200, eos_token_ids=[TOKENIZER.eos_token_id], **spec)
    return interleaved_rollout(prompts, ScriptedBackend(TOKENIZER, scripts), sandbox or FakeSandbox(), TOKENIZER, spec)


# ------------------------------------------------------------------------------------------------ void turns
def test_void_turns_are_counted():
    scripts = [
        "\\boxed{1}",  # answer: fine
        "<code>print(1)</code>so \\boxed{1}",  # code turn, then answer turn: fine
        "<code>print(1)</code>I give up",  # second turn has neither code nor answer
        "stray</code>then nothing",  # a stop without code, then an empty-handed final turn
    ]
    assert rollout(scripts).num_void_turns == [0, 0, 1, 2]


@pytest.mark.parametrize("enabled", [True, False])
def test_void_turn_filter_zeroes_the_completions_loss_weight(tmp_path, enabled):
    scripts = ["\\boxed{42}", "<code>print(1)</code>hmm", "\\boxed{41}", "<code>print(6*7)</code>\\boxed{42}"]
    trainer = trainer_for(tmp_path, scripts, filter_void_turns=enabled)
    inputs = trainer._generate_and_score_completions(batch())
    weights = (inputs["tool_mask"] * inputs["completion_mask"]).sum(dim=1)
    assert (weights[1] == 0).item() is enabled
    assert all(weights[i] > 0 for i in (0, 2, 3))
    assert trainer._metrics["train"]["retool/dropped_from_loss_ratio"] == [0.25 if enabled else 0.0]


# ------------------------------------------------------------------------------------------------ infra failures
class FlakySandbox(FakeSandbox):
    """Fails the first `failures` run_many calls for infrastructure reasons, then works."""

    def __init__(self, failures):
        super().__init__()
        self.failures = failures

    def run_many(self, pairs):
        if self.failures:
            self.failures -= 1
            return [ExecResult("SandboxError: worker lost", False, False, 0.0, infra_error=True) for _ in pairs]
        return super().run_many(pairs)


def test_infra_failure_is_retried_once():
    result = rollout(["<code>print(6*7)</code>\\boxed{42}"], sandbox=FlakySandbox(failures=1))
    assert result.infra_failed == [False] and result.num_infra_errors == [0]
    assert "<interpreter>42\n</interpreter>" in TOKENIZER.decode(result.completion_ids[0])


class FailsOneCell(FakeSandbox):
    """Fails every run of `print(6*7)` for infrastructure reasons (retry included); runs the other cells."""

    def run_many(self, pairs):
        return [
            ExecResult("SandboxError: worker lost", False, False, 0.0, infra_error=True)
            if code == "print(6*7)"
            else FakeSandbox.run_many(self, [(session, code)])[0]
            for session, code in pairs
        ]


def test_persistent_infra_failure_is_dropped_and_never_scored_minus_one(tmp_path):
    # Another row's call runs: a step in which *every* call failed stops training instead (test_no_silent_failure).
    scripts = ["<code>print(6*7)</code>\\boxed{42}", "<code>print(1)</code>\\boxed{41}", "\\boxed{42}", "\\boxed{40}"]
    trainer = trainer_for(tmp_path, scripts, sandbox=FailsOneCell())
    seen = record_rewards(trainer)
    inputs = trainer._generate_and_score_completions(batch())
    rewards = seen["rewards"][:, 0]
    assert torch.isnan(rewards[0]) and rewards[1:].tolist() == [-1.0, 1.0, -1.0]  # unscored, not -1
    assert inputs["advantages"][0].item() == 0.0
    assert (inputs["tool_mask"][0] * inputs["completion_mask"][0]).sum() == 0  # out of the loss


def test_boxed_accuracy_leaves_infra_failures_unscored():
    assert boxed_accuracy(["\\boxed{1}", "\\boxed{2}"], ["1", "1"], infra_failed=[True, False]) == [None, -1.0]


# ------------------------------------------------------------------------------------------------ tool-use shaping
def test_tool_use_shaping_rewards_only_wrong_answers_that_called_code():
    completions = ["\\boxed{1}", "\\boxed{2}", "\\boxed{2}", "\\boxed{1}"]
    shaped = tool_use_shaping(completions, ["1"] * 4, num_tool_calls=[1, 1, 0, 0], tool_use_bonus=0.2)
    assert shaped == [0.0, 0.2, 0.0, 0.0]
    total = [a + b for a, b in zip(boxed_accuracy(completions, ["1"] * 4), shaped)]
    assert total[1] > total[2] and total[1] < total[0] - 1.5


def test_tool_use_bonus_adds_the_reward_and_is_bounded(tmp_path):
    trainer = trainer_for(tmp_path, ["x"] * 4, tool_use_bonus=0.1)
    assert trainer.reward_funcs[-1].__wrapped__ is tool_use_shaping  # bound to the config by the trainer
    with pytest.raises(ValueError, match="tool_use_bonus"):
        ReToolConfig(output_dir=str(tmp_path), tool_use_bonus=1.5, use_cpu=True, bf16=False)


# ------------------------------------------------------------------------------------------------ GRPO-RoC
def test_resample_on_correct_keeps_proportions_and_clean_positives():
    correct = [True, True, True, True, False, False, False, False]
    problems = [2, 0, 1, 0, 5, 0, 3, 1]
    kept = resample_on_correct(correct, problems, keep=4, rng=random.Random(0))
    assert len(kept) == 4
    assert [i for i in kept if correct[i]] == [1, 3]  # the two positives without problems
    assert len([i for i in kept if not correct[i]]) == 2
    # all wrong or all right: the group is still filled
    assert len(resample_on_correct([False] * 6, [0] * 6, keep=3, rng=random.Random(0))) == 3
    assert resample_on_correct([True] * 4, [3, 0, 2, 1], keep=2, rng=random.Random(0)) == [1, 3]


def test_trainer_oversamples_and_keeps_group_size(tmp_path):
    scripts = [  # 2 x 4 samples for one prompt: 4 right (two with a tool error), 4 wrong
        "<code>1/0</code>\\boxed{42}",
        "\\boxed{42}",
        "<code>print(6*7)</code>\\boxed{42}",
        "<code>x</code>\\boxed{42}",
        "\\boxed{1}",
        "\\boxed{2}",
        "\\boxed{3}",
        "\\boxed{4}",
    ]
    trainer = trainer_for(tmp_path, scripts, roc_oversample=2)
    seen = {}

    def spy(completions, model_text, num_tool_errors, **kw):
        seen.update(text=model_text, errors=num_tool_errors)
        return [0.0] * len(completions)

    trainer.reward_funcs = [spy]
    trainer.reward_func_names = ["spy"]
    trainer.reward_processing_classes = [None]
    inputs = trainer._generate_and_score_completions(batch())
    assert inputs["completion_ids"].shape[0] == 4
    right = [t for t in seen["text"] if t.endswith("\\boxed{42}")]
    assert len(right) == 2 and seen["errors"][: len(seen["errors"])].count(0) >= 2
    assert set(right) <= {"\\boxed{42}", "<code>print(6*7)</code>\\boxed{42}"}  # the error-free right ones


# ------------------------------------------------------------------------------------------------ truncation side
@pytest.mark.parametrize("side, keeps", [("head", "START"), ("tail", "END"), ("middle", "START")])
def test_interpreter_truncation_side(side, keeps):
    result = rollout(
        ["<code>print('START' + 'x' * 500 + 'END')</code>done"],
        max_interpreter_output_chars=80,
        interpreter_truncation=side,
    )
    env = TOKENIZER.decode([t for t, m in zip(result.completion_ids[0], result.interpreter_mask[0]) if not m])
    body = env[len("<interpreter>") : -len("</interpreter>")]
    assert len(body) <= 80 and keeps in body
    if side == "middle":
        assert "END" in body
    if side == "tail":
        assert "START" not in body
