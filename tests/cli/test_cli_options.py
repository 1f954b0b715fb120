"""What each command accepts: its own options only, the reward kwargs the trainer really provides, and
`prompt_format: auto` for base models (no chat template) and chat models."""

import inspect
import json
import logging
from pathlib import Path

import pytest
import yaml

from helpers.testing_utils import make_char_tokenizer, save_tiny_model
from retool_trl.cli import main
from retool_trl.cli import train as cli_train
from retool_trl.errors import UserError
from retool_trl.rewards.registry import TRL_REWARD_KWARGS, check_reward_kwargs
from retool_trl.rollout import ROLLOUT_FIELDS

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
REWARDS_MODULE = """
CALLS = []


def needs_rollout_facts(completions, num_void_turns, model_text, infra_failed, **kwargs):
    CALLS.append({"n": len(completions), "void": list(num_void_turns), "text": list(model_text)})
    return [float(i % 3) for i in range(len(completions))]
"""


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_options")
    save_tiny_model(root / "base_model", make_char_tokenizer())  # a base model: no chat template
    chat = make_char_tokenizer()
    chat.chat_template = CHAT_TEMPLATE
    save_tiny_model(root / "chat_model", chat)
    with open(root / "plain.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"What is {i}+{i}?\n", "answer": str(2 * i)}) + "\n")
    with open(root / "messages.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"{i}+1?"}], "answer": str(i + 1)}) + "\n")
    (root / "fact_rewards.py").write_text(REWARDS_MODULE)
    return root


def train_yaml(work, tmp_path, **overrides) -> str:
    """A two-prompt, one-step config that leaves `prompt_format` at its default."""
    values = dict(
        model_name_or_path=str(work / "base_model"),
        dataset_name=str(work / "plain.jsonl"),
        system_prompt="none",
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=1,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        sandbox_workers=1,
        seed=0,
    )
    values.update(overrides)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


# ----------------------------------------------------------------------------------------------- own options only
def help_options(capsys, command: str, flag: str = "--help") -> set[str]:
    assert main([command, flag]) == 0
    return {word.rstrip(",") for word in capsys.readouterr().out.split() if word.startswith("--")}


def test_eval_help_lists_only_evaluation_options(capsys):
    options = help_options(capsys, "eval")
    wanted = {
        "--model",
        "--dataset",
        "--num_samples",
        "--temperature",
        "--top_p",
        "--max_completion_length",
        "--max_tool_calls",
        "--code_start",
        "--sandbox_backend",
        "--sandbox_timeout_s",
        "--system_prompt",
        "--output_dir",
        "--seed",
    }
    assert wanted <= options, wanted - options
    training = {
        "--learning_rate",
        "--adam_beta1",
        "--lr_scheduler_type",
        "--optim",
        "--weight_decay",
        "--beta",
        "--num_generations",
        "--gradient_accumulation_steps",
        "--lora_r",
        "--use_vllm",
        "--save_strategy",
    }
    assert not training & options, training & options
    # Training still has them all (its full list is `--help-all`; `--help` is the short one).
    assert training - {"--lora_r"} <= help_options(capsys, "train", "--help-all")


def test_eval_rejects_a_training_option(capsys):
    assert main(["eval", "--model", "m", "--dataset", "d", "--learning_rate", "0.1"]) == 2
    assert "unknown argument '--learning_rate'" in capsys.readouterr().err


def test_eval_options_keep_the_config_defaults():
    """Evaluation's sampling/interpreter options are ReToolConfig's fields: same defaults, same help."""
    from retool_trl import ReToolConfig
    from retool_trl.cli.eval import _settings_class

    settings = _settings_class()
    ours = {f.name: f for f in settings.__dataclass_fields__.values()}
    theirs = ReToolConfig.__dataclass_fields__
    for name, spec in ours.items():
        if name != "output_dir":
            assert spec.default == theirs[name].default and spec.metadata == theirs[name].metadata, name


# ----------------------------------------------------------------------------------------------- reward kwargs
def reward_requiring(name: str):
    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    names = ["completions", name] if name != "completions" else ["completions"]
    reward.__signature__ = inspect.Signature([inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in names])
    reward.__name__ = f"needs_{name}"
    return reward


@pytest.mark.parametrize("name", [*ROLLOUT_FIELDS, *TRL_REWARD_KWARGS, "answer"])
def test_reward_kwargs_that_are_provided_are_accepted(name):
    check_reward_kwargs([reward_requiring(name)], ["prompt", "answer"], "'data.jsonl'")


@pytest.mark.parametrize("name", ["difficulty", "solution", "correct_reward", "tool_use_bonus"])
def test_reward_kwargs_nobody_provides_are_rejected(name):
    with pytest.raises(UserError, match=f"needs_{name}.*needs a dataset column '{name}'"):
        check_reward_kwargs([reward_requiring(name)], ["prompt", "answer"], "'data.jsonl'")


def test_reward_needing_rollout_facts_trains(work, tmp_path, monkeypatch):
    """Accepted by the check, and the trainer really hands it those facts (the independent truth)."""
    import importlib

    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))
    rewards = importlib.import_module("fact_rewards")
    rewards.CALLS.clear()
    cfg = train_yaml(work, tmp_path, reward_funcs=["fact_rewards.needs_rollout_facts"])
    assert main(["train", "--config", cfg]) == 0
    assert rewards.CALLS and all(len(c["void"]) == len(c["text"]) == c["n"] for c in rewards.CALLS)


# ----------------------------------------------------------------------------------------------- prompt_format auto
def test_auto_base_model_with_plain_prompts_trains_and_evaluates(work, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="retool_trl")
    seen = {}
    real = cli_train.build_train
    monkeypatch.setattr(cli_train, "build_train", lambda argv: seen.setdefault("trainer", real(argv)))
    assert main(["train", "--config", train_yaml(work, tmp_path)]) == 0
    assert seen["trainer"].train_dataset[0]["prompt"] == "What is 0+0?\n"
    assert (Path(tmp_path) / "out" / "trainer_state.json").is_file()
    assert "prompt_format auto: plain prompts" in caplog.text
    out = tmp_path / "eval"
    assert (
        main(
            [
                "eval",
                "--model",
                str(work / "base_model"),
                "--dataset",
                str(work / "plain.jsonl"),
                "--system_prompt",
                "none",
                "--max_samples",
                "2",
                "--max_completion_length",
                "6",
                "--sandbox_workers",
                "1",
                "--output_dir",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads((out / "results.json").read_text())["num_problems"] == 2


def test_auto_chat_model_picks_conversational(work, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="retool_trl")
    cfg = train_yaml(work, tmp_path, model_name_or_path=str(work / "chat_model"))
    trainer = cli_train.build_train(["--config", cfg])
    try:
        assert trainer.train_dataset[0]["prompt"] == [{"role": "user", "content": "What is 0+0?\n"}]
        assert "prompt_format auto: conversational prompts (the tokenizer has a chat template)" in caplog.text
    finally:
        trainer.close_sandbox()


def test_auto_conversations_need_a_chat_template(work, tmp_path, capsys):
    cfg = train_yaml(work, tmp_path, dataset_name=str(work / "messages.jsonl"))
    assert main(["train", "--config", cfg]) == 2
    assert "has no chat template, which conversational prompts need" in capsys.readouterr().err


def sft_yaml(work, tmp_path, **overrides) -> str:
    values = dict(
        model_name_or_path=str(work / "base_model"),
        dataset_name=str(work / "traces.jsonl"),
        output_dir=str(tmp_path / "sft"),
        per_device_train_batch_size=2,
        max_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        use_cpu=True,
        max_length=128,
        gradient_checkpointing=False,
    )
    values.update(overrides)
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


@pytest.fixture(scope="module")
def traces(work):
    with open(work / "traces.jsonl", "w") as f:
        for i in range(4):
            completion = f"<code>print({i}*7)</code><interpreter>{i * 7}\n</interpreter>\\boxed{{{i * 7}}}"
            f.write(json.dumps({"prompt": f"What is {i}*7?\n", "completion": completion}) + "\n")
    with open(work / "chats.jsonl", "w") as f:
        f.write(
            json.dumps(
                {"messages": [{"role": "user", "content": "2*3?"}, {"role": "assistant", "content": "\\boxed{6}"}]}
            )
            + "\n"
        )


def test_sft_prompt_format(work, tmp_path, traces, capsys):
    from retool_trl.cli.sft import build_sft

    plain = build_sft(["--config", sft_yaml(work, tmp_path)])  # auto: plain-text traces stay plain text
    assert plain.processing_class.decode(plain.train_dataset[0]["input_ids"]).startswith("What is 0*7?\n<code>")
    chat = build_sft(
        [
            "--config",
            sft_yaml(work, tmp_path, model_name_or_path=str(work / "chat_model"), prompt_format="conversational"),
        ]
    )
    assert chat.processing_class.decode(chat.train_dataset[0]["input_ids"]).startswith("user: What is 0*7?")
    assert (
        main(
            [
                "sft",
                "--config",
                sft_yaml(work, tmp_path, dataset_name=str(work / "chats.jsonl"), prompt_format="plain"),
            ]
        )
        == 2
    )
    assert "holds conversations, which prompt_format: plain cannot train on" in capsys.readouterr().err
