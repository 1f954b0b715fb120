"""The call format (and how the interpreter answered) travels with the model from `sft` to `eval` and `train`.

The real condition: a new user cold-starts a model in `tool_call` or `markdown`, then evaluates and trains it with
the commands the docs show, without repeating `--call_format`. Each of these once went wrong: `sft` recorded no
format and `eval` of its folder silently used `tags` (code ratio 0%); resuming a `tool_call` run with another format
was accepted and rewrote the run's recorded format; the no-chat-template error for `tool_call` told the user to set
`prompt_format: plain`, which gave the same error again; a LoRA run from a relative model path stored that relative
path, and evaluating it from another folder spent a minute on the hub before a long traceback.
"""

from __future__ import annotations

import json
import os

import pytest

from retool_trl.cli import main
from retool_trl.errors import UserError
from retool_trl.format.prompts import PROMPT_SETTINGS
from retool_trl.models.tiny import build_char_tokenizer, save_tiny_model

TRACE = {"prompt": "What is 6*7?\n", "completion": "<code>print(6*7)</code><interpreter>42\n</interpreter>\\boxed{42}"}


@pytest.fixture(scope="module")
def cold_started(tmp_path_factory):
    """`retool-trl sft --call_format markdown` on a tiny model, one step."""
    root = tmp_path_factory.mktemp("sft")
    traces = root / "traces.jsonl"
    traces.write_text((json.dumps(TRACE) + "\n") * 4)
    model = save_tiny_model(root / "base", build_char_tokenizer())
    out = root / "sft"
    argv = ["sft", "--model_name_or_path", model, "--dataset_name", str(traces), "--output_dir", str(out)]
    argv += ["--call_format", "markdown", "--max_steps", "1", "--report_to", "none", "--use_cpu", "true"]
    argv += ["--save_strategy", "steps", "--save_steps", "1", "--per_device_train_batch_size", "2"]
    assert main(argv) == 0
    return out


def test_sft_records_the_format_in_the_model_and_its_checkpoints(cold_started):
    for folder in (cold_started, cold_started / "checkpoint-1"):
        recorded = json.loads((folder / PROMPT_SETTINGS).read_text())
        assert recorded["call_format"] == "markdown" and recorded["code_start"] == "<code>"


def test_eval_of_a_cold_started_model_uses_its_format_and_says_so(cold_started, tmp_path, capsys):
    problems = tmp_path / "problems.jsonl"
    problems.write_text(
        "".join(json.dumps({"prompt": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(2))
    )
    argv = ["eval", "--model", str(cold_started), "--dataset", str(problems), "--output_dir", str(tmp_path / "eval")]
    assert main(argv + ["--max_completion_length", "8", "--sandbox_workers", "1"]) == 0
    assert "call_format='markdown'" in capsys.readouterr().out
    results = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert results["settings"]["call_format"] == "markdown"


def train_argv(out, *extra):
    return ["--model_name_or_path", "quickstart", "--dataset_name", "arithmetic", "--output_dir", str(out), *extra]


def test_resuming_in_another_format_is_refused_in_one_line(tmp_path):
    from retool_trl.cli.train import build_train

    checkpoint = tmp_path / "run" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / PROMPT_SETTINGS).write_text(json.dumps({"call_format": "tool_call"}))
    (checkpoint / "trainer_state.json").write_text("{}")
    with pytest.raises(
        UserError, match=r"checkpoint-2 was trained with call_format='tool_call'.*call_format: tool_call"
    ):
        build_train(train_argv(tmp_path / "run", "--resume_from_checkpoint", "true", "--call_format", "markdown"))
    assert json.loads((checkpoint / PROMPT_SETTINGS).read_text()) == {"call_format": "tool_call"}


def test_a_tool_call_run_without_a_chat_template_is_told_about_chat_template_path(tmp_path):
    """The shipped tiny model has no chat template; setting `prompt_format: plain` would not help."""
    from retool_trl.cli.train import build_train

    for extra in ([], ["--prompt_format", "plain"]):
        with pytest.raises(UserError, match="call_format='tool_call' needs: give one with `--chat_template_path`"):
            build_train(train_argv(tmp_path / "run", "--call_format", "tool_call", *extra))


def test_a_local_model_path_is_recorded_absolute(tmp_path, monkeypatch):
    from retool_trl.cli.common import resolve_model_path

    save_tiny_model(tmp_path / "models" / "tiny", build_char_tokenizer())
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("models/tiny") == str(tmp_path / "models" / "tiny")


def test_a_lora_adapter_with_a_relative_base_is_found_from_another_folder(tmp_path, monkeypatch):
    from retool_trl.cli.eval import adapter_base

    base = tmp_path / "work" / "models" / "tiny"
    base.mkdir(parents=True)
    adapter = tmp_path / "work" / "runs" / "lora"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "models/tiny"}))
    monkeypatch.chdir(tmp_path)  # not the folder the run was started from
    assert os.path.samefile(adapter_base(str(adapter)), base)


def test_a_missing_lora_base_is_one_line_without_the_hub(tmp_path, monkeypatch):
    from retool_trl.cli.eval import adapter_base

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "./gone/tiny"}))
    with pytest.raises(UserError, match="trained on the base model './gone/tiny', which is not a folder here"):
        adapter_base(str(tmp_path))


def test_a_recorded_format_unknown_here_is_one_line(tmp_path):
    """A model trained with a plugin's format, evaluated where the plugin is not installed."""
    from types import SimpleNamespace

    from retool_trl.cli.common import take_trained_prompt_settings

    (tmp_path / PROMPT_SETTINGS).write_text(json.dumps({"call_format": "json_block"}))
    config = SimpleNamespace(call_format="tags")
    with pytest.raises(UserError, match="records call_format='json_block', which is not a call format here"):
        take_trained_prompt_settings(str(tmp_path), SimpleNamespace(prompt_format="auto"), config, set())
