"""ReToolTrainer on top of GRPOTrainer: the interpreter mask reaches TRL's loss, TRL's machinery is reused."""

import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from helpers.testing_utils import (
    MASK_LOSS_TYPES,
    TOOL_SCRIPTS,
    FakeSandbox,
    ScriptedBackend,
    interpreter_token_gradients,
    ramp_reward,
    save_tiny_model,
)
from retool_trl import ReToolConfig, ReToolTrainer

SCRIPTS = TOOL_SCRIPTS


def config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=96,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        use_cpu=True,
        beta=0.1,
        seed=0,
    )
    values.update(overrides)
    return values


def batch(n=4, prompt="Q: what is 6*7?"):
    return [{"prompt": prompt, "answer": "42"} for _ in range(n)]


def scored_inputs(trainer):
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop
    return trainer._generate_and_score_completions(batch())


def make_trainer(tmp_path, tokenizer, reward_funcs=ramp_reward, sandbox=None, **overrides):
    return ReToolTrainer(
        save_tiny_model(tmp_path / "model", tokenizer),
        reward_funcs=reward_funcs,
        args=ReToolConfig(**config(tmp_path, **overrides)),
        train_dataset=Dataset.from_list(batch(8)),
        processing_class=tokenizer,
        sandbox=sandbox or FakeSandbox(),
    )


def scripted_trainer(tmp_path, tokenizer, scripts=SCRIPTS, reward_funcs=ramp_reward, sandbox=None, **overrides):
    trainer = make_trainer(tmp_path, tokenizer, reward_funcs, sandbox, **overrides)
    trainer._make_generation_backend = lambda model: ScriptedBackend(tokenizer, scripts)
    return trainer


@pytest.mark.parametrize("loss_type", MASK_LOSS_TYPES)
def test_interpreter_tokens_get_exactly_zero_gradient(tmp_path, char_tokenizer, loss_type):
    trainer = scripted_trainer(tmp_path, char_tokenizer, loss_type=loss_type, num_iterations=2)
    inputs = scored_inputs(trainer)
    tool_mask, completion_mask = inputs["tool_mask"], inputs["completion_mask"]
    assert (tool_mask == 0).any() and (tool_mask == 1).any()
    assert inputs["ref_per_token_logps"] is not None  # beta > 0: the KL term is in the loss

    per_token, masked = interpreter_token_gradients(trainer, inputs)
    assert per_token.shape == tool_mask.shape
    assert torch.equal(masked, (tool_mask * completion_mask) == 0)
    assert torch.all(per_token[masked] == 0), "interpreter/padding tokens contribute to the gradient"
    assert torch.all(per_token[~masked] > 0), "some model tokens get no gradient"


def test_no_code_batch_loss_equals_grpo_trainer(tmp_path, char_tokenizer):
    scripts = ["\\boxed{42}", "I think 41", "maybe \\boxed{7} yes", "no"]
    retool = scripted_trainer(tmp_path / "a", char_tokenizer, scripts=scripts)
    grpo_model = str(tmp_path / "a" / "model")  # the same weights, loaded again
    fixed = [char_tokenizer(s, add_special_tokens=False)["input_ids"] + [char_tokenizer.eos_token_id] for s in scripts]

    def replay(prompts, trainer):
        return {"prompt_ids": char_tokenizer(prompts)["input_ids"], "completion_ids": fixed, "logprobs": None}

    grpo = GRPOTrainer(
        grpo_model,
        reward_funcs=ramp_reward,
        args=GRPOConfig(**config(tmp_path / "b")),
        train_dataset=Dataset.from_list(batch(8)),
        processing_class=char_tokenizer,
        rollout_func=replay,
    )
    losses = []
    for trainer in (retool, grpo):
        inputs = scored_inputs(trainer)
        assert inputs["completion_ids"].tolist()[0][: len(fixed[0])] == fixed[0]
        losses.append(trainer.compute_loss(trainer.model, inputs))
        losses[-1].backward()
    torch.testing.assert_close(losses[0], losses[1])
    for p, q in zip(retool.model.parameters(), grpo.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_rollout_facts_reach_reward_functions(tmp_path, char_tokenizer):
    seen = {}

    def spy(completions, model_text, num_tool_calls, num_tool_errors, answer, **kwargs):
        seen.update(model_text=model_text, calls=num_tool_calls, errors=num_tool_errors, answer=answer)
        return [0.0] * len(completions)

    trainer = scripted_trainer(tmp_path, char_tokenizer, reward_funcs=spy)
    trainer.model.train()
    trainer._generate_and_score_completions(batch())
    # Row 2 reads `x`, defined only in row 0's session: a NameError, since sessions never share state.
    assert seen["calls"] == [1, 0, 2, 1] and seen["errors"] == [0, 0, 1, 1]
    assert seen["model_text"] == SCRIPTS and seen["answer"] == ["42"] * 4
    metrics = trainer._metrics["train"]
    assert metrics["retool/code_ratio"] == [0.75]
    assert metrics["retool/calls_per_completion"] == [1.0]
    assert metrics["retool/error_rate"] == [0.5]


def test_default_reward_ignores_answers_printed_by_code(tmp_path, char_tokenizer):
    scripts = [
        "<code>print('\\\\boxed{42}')</code>",  # the interpreter prints \boxed{42}; the model never says it
        "<code>print(6*7)</code> so \\boxed{42}",  # the model states it
        "<code>x = '\\\\boxed{42}'</code>",  # written inside code only
        "\\boxed{41}",
    ]
    trainer = scripted_trainer(tmp_path, char_tokenizer, scripts=scripts, reward_funcs=None)
    trainer.model.train()
    seen = {}
    original = trainer._calculate_rewards

    def spy(inputs, prompts, completions, completion_ids_list):
        rewards = original(inputs, prompts, completions, completion_ids_list)
        seen["rewards"] = rewards[:, 0].tolist()
        seen["completions"] = completions
        return rewards

    trainer._calculate_rewards = spy
    trainer._generate_and_score_completions(batch())
    assert "\\boxed{42}" in seen["completions"][0]  # visible in the full text, interpreter output included
    assert seen["rewards"] == [-1.0, 1.0, -1.0, -1.0]


def test_train_steps_with_local_sandbox_log_and_save(tmp_path, char_tokenizer):
    """Real code execution in the default sandbox (built from the config, owned and closed by the trainer)."""
    import psutil

    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    trainer = ReToolTrainer(
        save_tiny_model(tmp_path / "model", char_tokenizer),
        args=ReToolConfig(**config(tmp_path, max_steps=2, sandbox_workers=2)),
        train_dataset=Dataset.from_list(batch(8)),
        processing_class=char_tokenizer,
    )
    trainer._make_generation_backend = lambda model: ScriptedBackend(char_tokenizer, SCRIPTS)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    logs = trainer.state.log_history
    assert len([entry for entry in logs if "loss" in entry]) == 2
    assert any(entry.get("retool/code_ratio") == 0.75 for entry in logs)
    # 1/0 and a NameError really raised in the sandbox (a traceback can use up a completion's budget, so > 0)
    assert all(entry.get("retool/error_rate", 1) > 0 for entry in logs)
    assert any("retool/sandbox_latency_ms_mean" in entry for entry in logs)
    assert (tmp_path / "final" / "model.safetensors").exists()
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    # The sandbox workers are gone once train() returns: no leftover or zombie processes.
    leftover = [p for p in psutil.Process().children(recursive=True) if p.pid not in children_before]
    assert leftover == [], leftover


def test_train_with_real_generate_backend(tmp_path, char_tokenizer):
    """The transformers backend end to end: a random tiny model samples; code, if any, really runs."""
    trainer = make_trainer(tmp_path, char_tokenizer, reward_funcs=None, max_steps=1, max_completion_length=24)
    trainer.train()
    assert any("retool/code_ratio" in entry for entry in trainer.state.log_history)


def test_config_rejects_bad_fields(tmp_path):
    with pytest.raises(ValueError, match="max_tool_calls"):
        ReToolConfig(**config(tmp_path, max_tool_calls=-1))
    with pytest.raises(ValueError, match="interpreter_truncation"):
        ReToolConfig(**config(tmp_path, interpreter_truncation="sideways"))
    with pytest.raises(ValueError, match="sandbox_url"):
        ReToolConfig(**config(tmp_path, sandbox_backend="remote"))
    with pytest.raises(ValueError, match="code_end"):
        ReToolConfig(**config(tmp_path, code_end=""))
    with pytest.raises(ValueError, match="distinct"):
        ReToolConfig(**config(tmp_path, interpreter_start="<code>"))
    with pytest.raises(ValueError, match="correct_reward"):
        ReToolConfig(**config(tmp_path, correct_reward=-1.0, incorrect_reward=1.0))


def test_trainer_rejects_conflicting_arguments(tmp_path, char_tokenizer):
    with pytest.raises(TypeError, match="ReToolConfig"):
        ReToolTrainer(
            save_tiny_model(tmp_path / "model", char_tokenizer),
            args=GRPOConfig(**config(tmp_path)),
            processing_class=char_tokenizer,
            train_dataset=Dataset.from_list(batch(8)),
        )
    with pytest.raises(ValueError, match="tools"):
        ReToolTrainer(
            save_tiny_model(tmp_path / "model", char_tokenizer),
            args=ReToolConfig(**config(tmp_path)),
            tools=[print],
            processing_class=char_tokenizer,
            train_dataset=Dataset.from_list(batch(8)),
        )


def test_system_prompt_is_added_to_conversational_prompts(tmp_path, char_tokenizer):
    args = ReToolConfig(**config(tmp_path, system_prompt="Use code."))
    trainer = scripted_trainer(tmp_path, char_tokenizer)
    trainer.args = args
    prompts = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "own"}, {"role": "user", "content": "x"}],
    ]
    out = trainer._with_system_prompt(prompts)
    assert out[0][0] == {"role": "system", "content": "Use code."} and out[1][0]["content"] == "own"
    assert trainer._with_system_prompt(["plain text"]) == ["plain text"]
