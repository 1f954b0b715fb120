"""A run without code is TRL's GRPOTrainer as it is, with its default precision."""

from __future__ import annotations

from retool_trl import ReToolConfig


# ------------------------------------------------------------------------------------------- TRL's defaults
def test_without_code_training_is_grpotrainers_with_default_precision(tmp_path):
    """TRL's own GRPO tests run against `ReToolTrainer`: with `use_cpu=True` and `bf16` left unset, `GRPOConfig` trains
    in bf16 mixed precision; a ReTool run whose model writes no code must train exactly as `GRPOTrainer` (before:
    `ReToolConfig` chose fp32 there: largest parameter difference 0.029 here, 0.31 in the review's run)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from helpers.testing_utils import make_char_tokenizer, save_tiny_model
    from retool_trl import ReToolTrainer

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
