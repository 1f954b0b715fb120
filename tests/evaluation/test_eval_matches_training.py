"""The evaluation of a trained model sees what training saw: the same prompts, the same end-of-turn ids."""

from __future__ import annotations

from helpers.testing_utils import (
    make_char_tokenizer,
    make_tiny_qwen2,
)
from retool_trl import ReToolConfig
from retool_trl.evaluation.inference import eos_token_ids_of


# ------------------------------------------------------------------------------ prompts as documented, eval as trained
def test_eval_of_a_trained_model_builds_its_prompts_as_training_did(tmp_path, capsys):
    """The quickstart's recipe on the shipped tiny model: plain-text prompts, `system_prompt: none`. `retool-trl eval`
    of the saved model, with no prompt flag, scores as with the training's settings given by hand (before: the default
    system prompt was put in front of the plain prompts, and the quickstart's trained model scored 0%)."""
    import json

    from retool_trl import ReToolTrainer
    from retool_trl.cli import main
    from retool_trl.data.synthetic import make_arithmetic_dataset
    from retool_trl.models.tokenizers import load_tokenizer
    from retool_trl.quickstart import model_path
    from retool_trl.sandbox import LocalSandbox

    tokenizer = load_tokenizer(model_path())
    config = ReToolConfig(
        output_dir=str(tmp_path / "run"),
        system_prompt="none",
        max_steps=1,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=48,
        max_tool_calls=2,
        learning_rate=1e-6,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    with LocalSandbox(num_workers=1, timeout_s=5.0) as sandbox:
        trainer = ReToolTrainer(
            model_path(),
            args=config,
            train_dataset=make_arithmetic_dataset(8, seed=0),
            processing_class=tokenizer,
            sandbox=sandbox,
        )
        trainer.train()
        trainer.save_model(str(tmp_path / "model"))
    recorded = json.loads((tmp_path / "model" / "retool_prompt.json").read_text())
    assert recorded["system_prompt"] == "none" and recorded["prompt_format"] == "plain"

    def evaluate(name, *flags):
        out = tmp_path / name
        argv = ["eval", "--model", str(tmp_path / "model"), "--dataset", "synthetic", "--max_samples", "12"]
        argv += ["--max_completion_length", "48", "--sandbox_workers", "1", "--output_dir", str(out)]
        assert main([*argv, *flags]) == 0
        return json.loads((out / "results.json").read_text())["metrics"]["pass@1"]

    as_trained = evaluate("by_hand", "--system_prompt", "none", "--prompt_format", "plain")
    assert as_trained >= 0.5  # the shipped model solves these with its training prompts
    assert evaluate("no_flags") == as_trained
    assert "Prompt settings as in training" in capsys.readouterr().out
    # A setting given on the command line or in --config still wins over the recorded one.
    from retool_trl.cli.eval import given_options, parse_eval_args, take_trained_prompt_settings

    (tmp_path / "eval.yaml").write_text("code_start: '[PY]'\n")
    config_file = str(tmp_path / "eval.yaml")
    argv = ["--model", "m", "--dataset", "synthetic", "--system-prompt", "Be brief.", "--config", config_file]
    given = given_options(argv)
    assert {"system_prompt", "code_start", "model", "dataset"} <= given
    eval_args, config = parse_eval_args(["--model", "m", "--dataset", "synthetic", "--system_prompt", "Be brief."])
    taken = take_trained_prompt_settings(str(tmp_path / "model"), eval_args, config, {"system_prompt"})
    assert config.system_prompt == "Be brief." and "system_prompt" not in taken and eval_args.prompt_format == "plain"


TOKENIZER = make_char_tokenizer()


def test_eval_stops_at_the_models_end_of_turn_ids():
    model = make_tiny_qwen2(TOKENIZER)
    model.generation_config.eos_token_id = [TOKENIZER.eos_token_id, 7]
    assert eos_token_ids_of(model, TOKENIZER) == [TOKENIZER.eos_token_id, 7]
