"""The arithmetic quickstart in the `markdown` and `tool_call` call formats: the shipped models, their tokenizers
with their format, and a short run of each. The five-seed figures are in docs/quickstart.md, rendered from
scripts/results/quickstart_{markdown,tool_call}.jsonl."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from retool_trl.data.synthetic import make_arithmetic_dataset
from retool_trl.format.markdown import MarkdownFormat
from retool_trl.format.prompts import read_prompt_settings
from retool_trl.format.tool_calls import TOOLS, ToolCallFormat
from retool_trl.quickstart import QuickstartArguments, QuickstartTask, model_path, run_quickstart
from retool_trl.quickstart.arithmetic import MARKDOWN_TOKENS

FORMATS = ("markdown", "tool_call")


def _load(call_format):
    path = Path(model_path(call_format))
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    return path, tokenizer, AutoModelForCausalLM.from_pretrained(path).eval()


def _problems(n=16):
    return make_arithmetic_dataset(n, seed=11, difficulty=QuickstartTask().difficulty, split="test")


@pytest.mark.parametrize("call_format", FORMATS)
def test_shipped_model_is_small_and_records_its_format(call_format):
    path, tokenizer, model = _load(call_format)
    assert sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) < 5 * 2**20
    assert model.config.vocab_size == len(tokenizer)
    assert read_prompt_settings(path)["call_format"] == call_format
    assert json.loads((path / "build_info.json").read_text())["call_format"] == call_format


@pytest.mark.parametrize("call_format", ("tags", *FORMATS))
def test_the_rebuild_commands_are_the_recorded_build(call_format):
    """The commands the docs and the missing-model error give (`MODEL_BUILDS`) are the stages the shipped model was
    built in, flag for flag (`build_info.json`, earlier stages in `continued_from`): a user who runs them gets the
    same training, not a shorter or different one."""
    import importlib.util
    import shlex

    from retool_trl.models.names import MODEL_BUILDS
    from retool_trl.quickstart.arithmetic import FORMAT_MODELS

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("build_qs", root / "scripts/build/build_quickstart_model.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    info = json.loads((Path(model_path(call_format)) / "build_info.json").read_text())
    stages = [*info.pop("continued_from", []), info]
    commands = MODEL_BUILDS[FORMAT_MODELS[call_format]]
    assert len(commands) == len(stages)
    for command, stage in zip(commands, stages):
        argv = shlex.split(command)
        assert argv[0] == "build_quickstart_model.py"
        args = build.parse_args(argv[1:])
        assert args.call_format == stage.get("call_format", "tags") == call_format  # the first builds named none
        recorded = {k: stage[k] for k in ("num_traces", "max_steps", "batch_size", "learning_rate", "seed")}
        assert {k: getattr(args, k) for k in recorded} == recorded, command
    for command in commands[1:]:  # a later stage continues the shipped folder's model
        assert (
            build.parse_args(shlex.split(command)[1:]).init_from
            == f"retool_trl/assets/{Path(model_path(call_format)).name}"
        )


def test_markdown_tokenizer_keeps_the_fences_whole_and_the_model_writes_them():
    _, tokenizer, model = _load("markdown")
    text = "```python\nprint(843*13)\n```\n```output\n10959\n```\n\\boxed{10959}"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert all(fence in tokens for fence in MARKDOWN_TOKENS) and MarkdownFormat.stop in tokens
    problems = _problems()
    batch = tokenizer(list(problems["prompt"]), return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=30, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    # Greedy decoding calls code; the call the format reads is the expression copied into print().
    fmt = MarkdownFormat()
    calls = [fmt.calls(t[: t.find(fmt.stop) + len(fmt.stop)]) if fmt.stop in t else [] for t in texts]
    copied = [c and c[0].code == f"print({e})" for c, e in zip(calls, problems["expression"])]
    assert sum(copied) >= len(texts) - 2, texts


def test_tool_call_tokenizer_round_trips_a_call_through_the_format():
    _, tokenizer, model = _load("tool_call")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    for token in ("<|im_start|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1
    # Digits stay single tokens: copying a number is copying its digits.
    assert len(tokenizer("10959", add_special_tokens=False)["input_ids"]) == 5
    fmt = ToolCallFormat(tokenizer)
    messages = [{"role": "user", "content": "What is 843*13?\n"}]
    call = {"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": "print(843*13)"}}}
    prefix = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, return_dict=False)
    full = tokenizer.apply_chat_template(
        [*messages, {"role": "assistant", "content": "", "tool_calls": [call]}], tools=TOOLS, return_dict=False
    )
    turn = full[len(prefix) : full.index(tokenizer.eos_token_id, len(prefix)) + 1]
    assert [c.code for c in fmt.calls(turn, prefix)] == ["print(843*13)"]
    # The tool's answer comes back in <tool_response>, up to the next assistant header.
    (result,) = fmt.result_ids(tokenizer, [["10959\n"]])
    assert "<tool_response>\n10959" in tokenizer.decode(result) and tokenizer.decode(result).endswith("assistant\n")
    # The shipped model writes such a call for a held-out problem, greedily: one call to the tool, read by the format,
    # printing an expression.
    problems = _problems(8)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tools=TOOLS, add_generation_prompt=True, return_dict=False
        )
        for p in problems["prompt"]
    ]
    codes = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=48, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )[0, len(ids) :].tolist()
        turn = out[: out.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in out else out
        codes += [c.code for c in fmt.calls(turn, ids)]
    assert len(codes) == len(prompts) and all(code.startswith("print(") for code in codes), codes


def test_call_format_is_validated():
    with pytest.raises(ValueError, match="call_format"):
        QuickstartArguments(call_format="json")
    with pytest.raises(ValueError, match="arithmetic task only"):
        QuickstartArguments(task="multiturn", call_format="markdown")


@pytest.mark.parametrize(("call_format", "markup"), [("markdown", "```python\n"), ("tool_call", "<tool_call>")])
def test_short_quickstart_names_the_format_and_shows_its_markup(tmp_path, call_format, markup):
    out = tmp_path / call_format
    run_quickstart(
        out,
        call_format=call_format,
        max_steps=1,
        prompts_per_step=2,
        num_generations=2,
        num_train=4,
        num_eval=4,
        threads=1,
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["call_format"] == call_format
    assert Path(summary["model"]).name == f"{call_format}_model"
    for run in ("tool_rl", "text_rl"):
        for key in ("accuracy_before", "accuracy_after", "code_ratio_before", "code_ratio_after"):
            assert 0 <= summary[run][key] <= 1
    samples = [json.loads(line) for line in (out / "tool_rl" / "eval_after_samples.jsonl").read_text().splitlines()]
    assert sum(markup in s["completion"] for s in samples) >= len(samples) // 2, samples
    # The trained model records its format, for `retool-trl eval` of it.
    assert read_prompt_settings(out / "tool_rl" / "model")["call_format"] == call_format
