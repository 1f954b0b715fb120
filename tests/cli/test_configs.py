"""Every shipped config parses into trainer arguments (with a tiny local model swapped in), so none of them rots."""

from pathlib import Path

import pytest
import yaml

from helpers.testing_utils import make_char_tokenizer, save_tiny_model
from retool_trl.cli.sft import parse_sft_args
from retool_trl.cli.train import build_train, parse_train_args
from retool_trl.data import find_known_dataset, is_local_dataset
from retool_trl.data.adapters import SYNTHETIC_NAMES

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TRAIN_CONFIGS = sorted(p for p in CONFIGS.glob("*.yaml") if not p.name.startswith("sft"))
SFT_CONFIGS = sorted(CONFIGS.glob("sft*.yaml"))
ACCELERATE_CONFIGS = sorted((CONFIGS / "accelerate").glob("*.yaml"))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("configs") / "model", make_char_tokenizer())


def cpu_overrides(tiny_model, tmp_path):
    # What differs on this machine: the model, no GPU (so no bf16 and no vLLM), and a scratch output folder.
    return [
        "--model_name_or_path",
        tiny_model,
        "--bf16",
        "false",
        "--use_cpu",
        "true",
        "--dtype",
        "float32",
        "--output_dir",
        str(tmp_path / "out"),
    ]


def test_configs_exist():
    assert {p.name for p in TRAIN_CONFIGS} >= {"quickstart.yaml", "retool_qwen2.5-7b_zero3.yaml"}
    assert SFT_CONFIGS and ACCELERATE_CONFIGS


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: p.name)
def test_train_configs_build_arguments(path, tiny_model, tmp_path):
    raw = yaml.safe_load(path.read_text())
    script_args, args, model_args = parse_train_args(
        ["--config", str(path), *cpu_overrides(tiny_model, tmp_path), "--use_vllm", "false"]
    )
    assert model_args.model_name_or_path == tiny_model and args.use_cpu and not args.use_vllm
    for key in ("learning_rate", "beta", "max_completion_length", "num_generations", "max_tool_calls"):
        if key in raw:
            assert getattr(args, key) == pytest.approx(float(raw[key])), key
    for name in (script_args.dataset_name, script_args.eval_dataset_name):
        if name:
            assert name in SYNTHETIC_NAMES or find_known_dataset(name) or is_local_dataset(name), name
    if model_args.use_peft:
        from trl import get_peft_config

        assert get_peft_config(model_args).r == model_args.lora_r


@pytest.mark.parametrize(
    "path", [p for p in TRAIN_CONFIGS if not p.name.startswith("quickstart")], ids=lambda p: p.name
)
def test_gpu_configs_follow_the_paper(path):
    """The settings the configs attribute to ReTool: no KL, 512 completions per optimizer step on the GPUs they
    are written for, DAPO-Math-17k training with AIME 2024 evaluation, vLLM colocated, bf16."""
    raw = yaml.safe_load(path.read_text())
    processes = 8 if "zero3" in path.name else 1
    assert raw["per_device_train_batch_size"] * raw["gradient_accumulation_steps"] * processes == 512
    assert raw["beta"] == 0.0 and raw["num_generations"] == 16 and raw["max_tool_calls"] == 8
    assert raw["dataset_name"] == "dapo_math" and raw["eval_dataset_name"] == "aime_2024"
    assert raw["use_vllm"] and raw["vllm_mode"] == "colocate" and raw["bf16"] and raw["gradient_checkpointing"]
    assert raw["learning_rate"] == (1e-6 if "zero3" in path.name else 1e-5)


def test_quickstart_config_builds_a_trainer(tiny_model, tmp_path):
    """The CPU config runs here: build its trainer on the synthetic task with the tiny model swapped in."""
    trainer = build_train(
        [
            "--config",
            str(CONFIGS / "quickstart.yaml"),
            *cpu_overrides(tiny_model, tmp_path),
            "--max_train_samples",
            "16",
        ]
    )
    try:
        assert len(trainer.train_dataset) == 16
        assert trainer.train_dataset[0]["prompt"].startswith("What is ")
        assert trainer.args.system_prompt == "none" and trainer.args.max_steps > 0
    finally:
        trainer.close_sandbox()


@pytest.mark.parametrize("path", SFT_CONFIGS, ids=lambda p: p.name)
def test_sft_configs_build_arguments(path, tiny_model, tmp_path):
    raw = yaml.safe_load(path.read_text())
    script_args, args, model_args = parse_sft_args(["--config", str(path), *cpu_overrides(tiny_model, tmp_path)])
    assert args.max_length == raw["max_length"] and args.learning_rate == pytest.approx(float(raw["learning_rate"]))
    assert script_args.dataset_name and script_args.interpreter_start == "<interpreter>"
    assert args.completion_only_loss is not False and not args.packing


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_configs_load(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    assert config.num_processes >= 1
    if "zero3" in path.name:
        assert config.distributed_type == "DEEPSPEED" and config.deepspeed_config["zero_stage"] == 3


def test_quickstart_config_matches_the_quickstart_command():
    """configs/quickstart.yaml is the `tool_rl` run of `retool-trl quickstart`: same settings."""
    from retool_trl import quickstart

    if not hasattr(quickstart, "QuickstartArguments"):
        pytest.skip("retool_trl.quickstart has no QuickstartArguments yet")
    defaults = quickstart.QuickstartArguments()
    raw = yaml.safe_load((CONFIGS / "quickstart.yaml").read_text())
    assert raw["per_device_train_batch_size"] == defaults.prompts_per_step * defaults.num_generations
    assert raw["num_generations"] == defaults.num_generations
    assert raw["max_train_samples"] == defaults.num_train
    for key in ("max_steps", "learning_rate", "beta", "temperature", "max_completion_length", "seed"):
        assert float(raw[key]) == pytest.approx(float(getattr(defaults, key))), key
    assert raw["lr_scheduler_type"] == "warmup_stable_decay"
    assert raw["lr_scheduler_kwargs"] == {"num_decay_steps": defaults.lr_decay_steps}
    assert int(raw["dataset_config"]) == quickstart.QuickstartTask().difficulty


def test_multiturn_config_matches_the_quickstart_command():
    """configs/quickstart_multiturn.yaml is the `tool_rl` run of `retool-trl quickstart --task multiturn`."""
    from retool_trl.quickstart import MULTITURN_DEFAULTS, MultiturnTask, QuickstartArguments

    defaults, task = QuickstartArguments(task="multiturn", **MULTITURN_DEFAULTS), MultiturnTask()
    raw = yaml.safe_load((CONFIGS / "quickstart_multiturn.yaml").read_text())
    assert raw["per_device_train_batch_size"] == defaults.prompts_per_step * defaults.num_generations
    for key in ("max_steps", "learning_rate", "beta", "temperature", "max_completion_length", "seed"):
        assert float(raw[key]) == pytest.approx(float(getattr(defaults, key))), key
    assert raw["lr_scheduler_type"] == "warmup_stable_decay"
    assert raw["lr_scheduler_kwargs"] == {"num_decay_steps": defaults.lr_decay_steps}
    for key in ("max_cell_chars", "max_tool_calls", "max_interpreter_output_chars"):
        assert raw[key] == getattr(task, key), key
    assert raw["interpreter_errors"] == "last_line" and raw["dataset_name"] == "multiturn"
    assert float(raw["dataset_config"]) == task.failing_start


def test_emerge_config_matches_the_quickstart_command():
    """configs/quickstart_emerge.yaml is the `tool_rl` run of `retool-trl quickstart --task emerge`: a user who
    trains from the config gets the documented run."""
    from retool_trl.quickstart import EMERGE_DEFAULTS, EmergeTask, QuickstartArguments

    defaults, task = QuickstartArguments(task="emerge", **EMERGE_DEFAULTS), EmergeTask()
    raw = yaml.safe_load((CONFIGS / "quickstart_emerge.yaml").read_text())
    assert raw["model_name_or_path"] == "quickstart_emerge"
    assert raw["per_device_train_batch_size"] == defaults.prompts_per_step * defaults.num_generations
    assert raw["max_train_samples"] == defaults.num_train
    for key in ("max_steps", "learning_rate", "beta", "temperature", "max_completion_length", "seed"):
        assert float(raw[key]) == pytest.approx(float(getattr(defaults, key))), key
    assert raw["lr_scheduler_type"] == "warmup_stable_decay"
    assert raw["lr_scheduler_kwargs"] == {"num_decay_steps": defaults.lr_decay_steps}
    assert int(raw["dataset_config"]) == task.difficulty and raw["reward_funcs"] == ["boxed_accuracy"]


def test_multiturn_config_trains(tmp_path):
    """`retool-trl train --config configs/quickstart_multiturn.yaml` with the shipped model, the real sandbox and
    the task's cell budget: two short steps, the cell limit reaches the rollout, recovery is logged."""
    trainer = build_train(
        [
            "--config",
            str(CONFIGS / "quickstart_multiturn.yaml"),
            "--output_dir",
            str(tmp_path / "out"),
            "--max_steps",
            "2",
            "--per_device_train_batch_size",
            "16",
            "--max_train_samples",
            "32",
        ]
    )
    seen = []
    original = trainer._generate_rollout
    trainer._generate_rollout = lambda ids: seen.append(original(ids)) or seen[-1]
    try:
        trainer.train()
    finally:
        trainer.close_sandbox()
    assert trainer.state.global_step == 2
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert {"retool/failing_cell_ratio", "rewards/boxed_accuracy_and_recovery/mean"} <= logged
    texts = [trainer._tokenizer.decode(ids) for result in seen for ids in result.completion_ids]
    calls = sum(text.count("<interpreter>") for text in texts)
    assert calls > 0
    # Every interpreter block is what the task's interpreter returns: a refused long cell, a one-line error or a
    # value; never a multi-line traceback.
    for text in texts:
        for block in text.split("<interpreter>")[1:]:
            body = block.split("</interpreter>")[0]
            assert body.count("\n") <= 1, body
