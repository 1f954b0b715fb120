"""The step's metrics count what the step scored and ran, and the IS correction refuses what would bias it.

Real conditions: a sandbox that fails for its own reasons (a worker lost, a service down) leaves a completion
unscored; the health probe runs one trivial cell before the first rollout; a model card's sampling (Qwen suggests
`repetition_penalty=1.05`) with vLLM and TRL's default importance-sampling correction. Each once went wrong:
`retool/accuracy` counted the unscored completion as wrong, the probe was counted as an interpreter call of the step,
and penalties passed the config although vLLM's processed log-probs carry them and the trainer's do not.
"""

from __future__ import annotations

import pytest
from datasets import Dataset

from retool_trl import ReToolConfig, ReToolTrainer
from retool_trl.rewards.functions import bind_config, boxed_accuracy
from retool_trl.sandbox import LocalSandbox
from retool_trl.testing import FakeSandbox, ScriptedBackend


def test_accuracy_leaves_out_unscored_completions_and_counts_them():
    logged = {}
    reward = bind_config(boxed_accuracy, ReToolConfig("/tmp/unused", report_to="none", use_cpu=True, bf16=False))
    texts = ["<code>print(6*7)</code>So \\boxed{42}.", "<code>print(6*7)</code>", "\\boxed{41}"]
    rewards = reward(
        completions=texts,
        answer=["42"] * 3,
        model_text=texts,
        num_tool_calls=[1, 1, 0],
        infra_failed=[False, True, False],
        log_metric=logged.__setitem__,
    )
    assert rewards == [1.0, None, -1.0]
    assert logged == {
        "retool/unscored": 1.0,
        "retool/accuracy": 0.5,
        "retool/accuracy_with_code": 1.0,
        "retool/accuracy_without_code": 0.0,
    }


@pytest.mark.parametrize("backend", ["fake", "local"])
def test_the_health_probe_is_not_a_call_of_the_step(tmp_path, backend):
    """With the real local sandbox too, whose own observer reports each call's waits and fresh jails to the step's
    metrics: the probe's cold start was once counted there (three fresh jails for two calls)."""
    rows = [{"prompt": "What is 6*7?", "answer": "42"}] * 2
    args = ReToolConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=64,
        max_steps=1,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        beta=0.0,
        save_strategy="no",
    )
    sandbox = FakeSandbox() if backend == "fake" else LocalSandbox(num_workers=1, timeout_s=10.0)
    trainer = ReToolTrainer("quickstart", args=args, train_dataset=Dataset.from_list(rows), sandbox=sandbox)
    script = "<code>print(6*7)</code>So \\boxed{42}."
    trainer._make_generation_backend = lambda model: ScriptedBackend(trainer.processing_class, [script, script])
    try:
        trainer.train()
    finally:
        sandbox.close()
    log = next(entry for entry in trainer.state.log_history if "loss" in entry)
    if backend == "fake":
        assert sum(sandbox.batches) == 3  # the probe ran: it is what this test is about
    assert log["retool/calls_per_completion"] == 1.0 and log["retool/interpreter/calls"] == 2.0
    assert log["retool/interpreter/fresh_jails"] <= 2.0


@pytest.mark.parametrize(
    "settings",
    [
        {"repetition_penalty": 1.05},
        {"generation_kwargs": {"presence_penalty": 0.5}},
        {"generation_kwargs": {"frequency_penalty": 0.5}},
        {"generation_kwargs": {"logit_bias": {"11": 5.0}}},
        {"generation_kwargs": {"repetition_penalty": 1.1}},
    ],
)
def test_penalties_and_bias_are_refused_with_the_is_correction(settings):
    generation_kwargs = settings.pop("generation_kwargs", None)
    args = ReToolConfig("/tmp/unused", report_to="none", use_cpu=True, bf16=False, **settings)
    # As __post_init__ checks it with vLLM on (constructing with use_vllm=True needs vLLM installed).
    args.use_vllm, args.vllm_importance_sampling_correction, args.generation_kwargs = True, True, generation_kwargs
    with pytest.raises(ValueError, match="with vllm_importance_sampling_correction biases the correction"):
        args._validate_generation_kwargs()
    args.vllm_importance_sampling_correction = False
    args._validate_generation_kwargs()  # without the correction, the setting is the user's to choose
