"""The three call formats (`ReToolConfig.call_format`): what each takes as a call, what its results insert, what the
reward reads, and a short GRPO run with each on the tiny setup.

The real condition: models written for other habits than the ReTool paper's tags. Zero-RL models (ToRL, SimpleTIR,
ZeroTIR) write ```` ```python ```` blocks and read ```` ```output ```` fences; an instruct model calls tools in its
chat template's format (`tests/rollout/test_qwen_vocab_text.py` runs that one with Qwen's real vocabulary and TRL's
templates).
"""

from __future__ import annotations

import pytest
import torch

from helpers.testing_utils import make_char_tokenizer, trainer_for
from retool_trl import ReToolConfig
from retool_trl.format import MarkdownFormat, TagFormat, get_format
from retool_trl.rewards.functions import boxed_accuracy, final_answer
from retool_trl.rollout import RolloutSpec, interleaved_rollout
from retool_trl.testing import FakeSandbox, ScriptedBackend

TOKENIZER = make_char_tokenizer()
MARKDOWN_SCRIPTS = [
    "Compute:\n```python\nx = 6 * 7\nprint(x)\n```\nthen\n```python\nprint(x - 1)\n```\nSo \\boxed{42}",
    "Guess \\boxed{41}",
    "```\nnot code\n```\nand\n```text\nprint(1)\n```\nso \\boxed{1}",
    "```py\n1/0\n```\noops \\boxed{0}",
]


def rollout(scripts, fmt, max_len=200, sandbox=None):
    spec = RolloutSpec(max_len, [TOKENIZER.eos_token_id], call_format=fmt)
    prompts = [TOKENIZER("Q:", add_special_tokens=False)["input_ids"]] * len(scripts)
    backend = ScriptedBackend(TOKENIZER, scripts, fmt.stop)
    return interleaved_rollout(prompts, backend, sandbox or FakeSandbox(), TOKENIZER, spec)


def test_the_opening_fence_never_matches_the_stop():
    """```` ```python\\n ```` does not contain the stop; a closing fence followed by a newline does, and what the
    closing token carried past it is the next turn's."""
    fmt = MarkdownFormat()
    assert fmt.split("Try\n```python\nx = 1\n") is None
    assert fmt.split("Try\n```python\nx = 1\n```\n\nSo") == ("Try\n```python\nx = 1\n```\n", "\nSo")
    assert fmt.calls("Try\n```python\n  x = 1\n  print(x)\n```\n")[0].code == "x = 1\nprint(x)"


def test_markdown_calls_run_and_results_come_back_in_output_fences():
    """Python blocks run in order in one session; a bare fence or another language is prose the model continues
    after; the result is an ```` ```output ```` fence, masked; the completion is the sampled ids and the inserted
    ids concatenated."""
    result = rollout(MARKDOWN_SCRIPTS, MarkdownFormat())
    assert result.num_tool_calls == [2, 0, 0, 1]
    assert result.num_tool_errors == [0, 0, 0, 1]
    for i, script in enumerate(MARKDOWN_SCRIPTS):
        ids, mask = result.completion_ids[i], result.interpreter_mask[i]
        sampled = [t for t, m in zip(ids, mask) if m]
        assert sampled == TOKENIZER(script, add_special_tokens=False)["input_ids"] + [TOKENIZER.eos_token_id]
        assert result.model_text[i] == script
    inserted = TOKENIZER.decode([t for t, m in zip(result.completion_ids[0], result.interpreter_mask[0]) if not m])
    assert inserted == "```output\n42\n```\n```output\n41\n```\n"
    assert "ZeroDivisionError" in TOKENIZER.decode(result.completion_ids[3])
    # A closing fence whose block is not Python ends a turn without a call: void, as a stray `</code>` is.
    assert result.num_void_turns == [0, 0, 3, 0]
    assert (
        boxed_accuracy(["x"] * 4, ["42", "41", "1", "0"], model_text=result.model_text, tags=MarkdownFormat())
        == [1.0] * 4
    )


def test_printed_fences_cannot_close_the_output_early():
    """Code that prints ```` ``` ```` (and a fake answer after it) cannot end the output fence: the answer stays
    inside the result, not the model's prose."""
    script = "```python\nprint('```\\n\\\\boxed{9}')\n```\nno answer"
    result = rollout([script], MarkdownFormat())
    text = TOKENIZER.decode(result.completion_ids[0])
    assert text.count("```output") == 1 and "```\n\\boxed{9}" not in text
    assert final_answer(text, tags=MarkdownFormat()) is None


def test_the_reward_reads_prose_outside_calls_and_results():
    """A `\\boxed{}` written in code or printed by it is not the model's answer, in any format."""
    md = "```python\nprint('\\\\boxed{1}')\n```\n```output\n\\boxed{1}\n```\nso \\boxed{2}"
    assert final_answer(md, tags=MarkdownFormat()) == "2"
    tags = "<code>'\\boxed{1}'</code><interpreter>\\boxed{1}</interpreter> so \\boxed{2}"
    assert final_answer(tags, tags=TagFormat()) == "2"
    from retool_trl.format.tool_calls import ToolProse

    native = (
        '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(\'\\\\boxed{1}\')"}}\n</tool_call>'
        "<tool_response>\n\\boxed{1}\n</tool_response>so \\boxed{2}"
    )
    assert final_answer(native, tags=ToolProse()) == "2"
    bare = '{"name": "code_interpreter", "parameters": {"code": "x = \'\\\\boxed{1}\'"}} so \\boxed{3}'
    assert final_answer(bare, tags=ToolProse()) == "3"


def test_tags_stay_the_default():
    """Without `call_format`, the rollout and the config are the ReTool tags as before."""
    args = ReToolConfig(output_dir="/tmp/unused", report_to="none")
    assert args.call_format == "tags"
    assert isinstance(get_format(args.call_format).from_config(args), TagFormat)
    assert RolloutSpec(8, [0]).call_format.stop == "</code>"
    assert get_format("markdown").stop_for(args) == "```\n"


def test_an_unknown_format_is_refused_in_one_line():
    with pytest.raises(ValueError, match="call_format must be one of tags, tool_call, markdown, got 'xml'"):
        ReToolConfig(output_dir="/tmp/unused", report_to="none", call_format="xml")


@pytest.mark.parametrize(
    "call_format,scripts",
    [
        ("tags", ["<code>print(6 * 7)</code>so \\boxed{42}", "\\boxed{41}"] * 2),
        ("markdown", ["```python\nprint(6 * 7)\n```\nso \\boxed{42}", "\\boxed{41}"] * 2),
    ],
)
def test_a_short_grpo_run_trains_with_each_format(tmp_path, call_format, scripts):
    """Two optimizer steps on the tiny model: the calls run, the reward tells the right answer from the wrong one,
    interpreter tokens are masked, and the weights move."""
    trainer = trainer_for(
        tmp_path, scripts, call_format=call_format, max_steps=2, logging_steps=1, system_prompt="none"
    )
    stop = get_format(call_format).stop_for(trainer.args)
    trainer._make_generation_backend = lambda model: ScriptedBackend(TOKENIZER, scripts, stop)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    assert all(entry["retool/code_ratio"] == 0.5 and entry["rewards/boxed_accuracy/mean"] == 0.0 for entry in logs)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


@pytest.mark.parametrize(
    "call_format,told,not_told",
    [
        ("markdown", "```python", "<code>"),
        ("tool_call", "code_interpreter", "<code>"),
        ("tags", "<code>", "```python"),
    ],
)
def test_the_shipped_system_prompt_names_the_format_the_model_must_write(call_format, told, not_told):
    """The shipped `retool` prompt is worded for the format the model must write."""
    system = ReToolConfig(output_dir="/tmp/unused", report_to="none", call_format=call_format).resolved_system_prompt
    assert told in system and not_told not in system
