"""What reward functions receive and what reaches the loss: only per-completion facts, and dropped rows logged with
their real length and kept out of the loss."""

import pytest
import torch

from helpers.testing_utils import (
    FakeSandbox,
    make_char_tokenizer,
    record_rewards,
    trainer_for,
)
from retool_trl.rewards.functions import boxed_accuracy
from retool_trl.rollout.batched import ROLLOUT_FIELDS
from retool_trl.sandbox import ExecResult

CHAR = make_char_tokenizer()


# ------------------------------------------------------------------- the trainer's side
def test_dropped_rows_are_logged_with_their_real_length_and_leave_the_loss(tmp_path):
    scripts = ["\\boxed{42}", "<code>print(1)</code>hmm", "\\boxed{41}", "<code>print(6*7)</code>\\boxed{42}"]
    trainer = trainer_for(tmp_path, scripts, filter_void_turns=True)
    inputs = trainer._generate_and_score_completions([{"prompt": "Q:", "answer": "42"} for _ in range(4)])
    model_tokens = [len(CHAR(s, add_special_tokens=False)["input_ids"]) + 1 for s in scripts]  # + EOS
    metrics = trainer._metrics["train"]
    assert metrics["completions/min_length"] == [min(model_tokens)]
    assert metrics["completions/max_length"] == [max(model_tokens)]
    assert metrics["retool/dropped_from_loss_ratio"] == [0.25]
    weights = (inputs["tool_mask"] * inputs["completion_mask"]).sum(dim=1).tolist()
    assert weights[1] == 0 and all(w > 0 for i, w in enumerate(weights) if i != 1)
    # ...and out of the normaliser the default loss (dapo) divides by: only the kept tokens count.
    assert trainer.args.loss_type == "dapo"
    assert inputs["num_items_in_batch"].item() == sum(weights)


def test_reward_functions_receive_only_per_completion_facts(tmp_path):
    seen = {}

    def user_reward(completions, correct_reward=None, code_start=None, tool_use_bonus=None, **kwargs):
        seen.update(kwargs, correct_reward=correct_reward, code_start=code_start, tool_use_bonus=tool_use_bonus)
        return [0.0] * len(completions)

    scripts = ["\\boxed{42}"] * 4
    trainer = trainer_for(
        tmp_path,
        scripts,
        reward_funcs=[boxed_accuracy, user_reward],
        correct_reward=2.0,
        tool_use_bonus=0.1,
        code_start="<code>",
    )
    rows = [{"prompt": "Q:", "answer": "42"} for _ in range(4)]
    trainer._generate_and_score_completions(rows)
    # The user's parameters that share a name with ReTool settings get nothing of ReTool's.
    assert seen["correct_reward"] is None and seen["code_start"] is None and seen["tool_use_bonus"] is None
    assert set(ROLLOUT_FIELDS) <= set(seen)
    trl_own = {"prompts", "completion_ids", "trainer_state", "log_metric", "log_extra", "environments"}
    assert set(seen) - set(ROLLOUT_FIELDS) - trl_own - {"correct_reward", "code_start", "tool_use_bonus"} == {"answer"}
    assert set(rows[0]) == {"prompt", "answer", *ROLLOUT_FIELDS}  # TRL writes the kwargs into the batch rows
    # ...while the built-in reward is configured from ReToolConfig: correct answers score correct_reward.
    rewards = trainer._metrics["train"]["rewards/boxed_accuracy/mean"]
    assert rewards == [2.0]


class PartlyDownSandbox(FakeSandbox):
    """Fails the cells that print 1 or 2 for its own reasons; runs the others (a step that fails every call stops
    the run instead: tests/training/test_no_silent_failure.py)."""

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
