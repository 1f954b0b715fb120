"""Cold-start SFT data in the call format RL will use: ReTool-style traces converted, tokenized exactly as the rollout
builds the same completion (same ids, the loss mask on the same tokens the interpreter mask covers).

The real condition: a user who cold-starts on a released ReTool-style trace set (code in `<code>`, output in
`<interpreter>`) before RL in another format; SFT that teaches other ids than RL samples would teach the wrong habit.
"""

from __future__ import annotations

import pytest
from datasets import Dataset

from helpers.testing_utils import make_char_tokenizer
from retool_trl.format.markdown import MarkdownFormat, to_markdown
from retool_trl.format.tool_calls import to_tool_messages
from retool_trl.rollout import RolloutSpec, interleaved_rollout
from retool_trl.sft import build_sft_dataset
from retool_trl.testing import FakeSandbox, ScriptedBackend

TRACE = (
    "Let me compute.\n<code>\n```python\nx = 6 * 7\nprint(x)\n```\n</code>\n<interpreter>42\n</interpreter>"
    "So \\boxed{42}"
)


def test_traces_convert_to_markdown_and_tool_messages():
    assert (
        to_markdown(TRACE)
        == "Let me compute.\n```python\nx = 6 * 7\nprint(x)\n```\n```output\n42\n```\nSo \\boxed{42}"
    )
    assert to_tool_messages(TRACE) == [
        {
            "role": "assistant",
            "content": "Let me compute.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "code_interpreter", "arguments": {"code": "x = 6 * 7\nprint(x)"}},
                }
            ],
        },
        {"role": "tool", "name": "code_interpreter", "content": "42\n"},
        {"role": "assistant", "content": "So \\boxed{42}"},
    ]


# A trace written for people: the output framed in blank lines, which the sandbox never prints.
FRAMED_TRACE = TRACE.replace("<interpreter>42\n</interpreter>", "<interpreter>\n42\n\n</interpreter>")


@pytest.mark.parametrize("trace", [TRACE, FRAMED_TRACE], ids=["as-printed", "framed-in-blank-lines"])
def test_markdown_sft_ids_are_the_rollouts(trace):
    """The converted trace, tokenized for SFT, is token for token the rollout of a policy writing it, with the loss
    mask exactly where the interpreter mask is 1, whether the trace shows the output as printed or framed in blank
    lines (released ReTool-style traces)."""
    tokenizer = make_char_tokenizer()
    sft = build_sft_dataset(
        Dataset.from_list([{"prompt": "Q:", "completion": trace}]), tokenizer, call_format="markdown"
    )
    written = "Let me compute.\n```python\nx = 6 * 7\nprint(x)\n```\nSo \\boxed{42}"
    prompt = tokenizer("Q:")["input_ids"]
    result = interleaved_rollout(
        [prompt],
        ScriptedBackend(tokenizer, [written], MarkdownFormat.stop),
        FakeSandbox(),
        tokenizer,
        RolloutSpec(200, [tokenizer.eos_token_id], call_format=MarkdownFormat()),
    )
    assert sft[0]["input_ids"] == prompt + result.completion_ids[0]
    assert sft[0]["completion_mask"] == [0] * len(prompt) + result.interpreter_mask[0]


def test_tool_call_sft_ids_are_the_rollouts():
    """With Qwen's real vocabulary and TRL's Qwen2.5 template: the trace as tool calls and tool messages, tokenized
    for SFT, is what the rollout builds when the policy makes those calls; assistant turns (their end-of-turn token
    included) are trained, the template's tool messages are not. The second output is framed in blank lines, as
    traces written for people show it: the tool message holds what the sandbox prints, as in the rollout."""
    from helpers.qwen_vocab import qwen_tokenizer, tool_prompt, with_template
    from retool_trl.format.tool_calls import ToolCallFormat

    tokenizer = with_template(qwen_tokenizer(), "qwen2_5")
    trace = (
        "I will compute it.<code>a = 6 * 7</code><interpreter></interpreter><code>print(a)</code>\n"
        "<interpreter>\n42\n\n</interpreter>The result is \\boxed{42}."
    )
    rows = [{"prompt": [{"role": "user", "content": "What is 6*7?"}], "completion": trace}]
    sft = build_sft_dataset(Dataset.from_list(rows), tokenizer, call_format="tool_call")
    written = (
        'I will compute it.\n<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "a = 6 * 7"}}\n'
        '</tool_call><|im_end|><tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(a)"}}\n'
        "</tool_call><|im_end|>The result is \\boxed{42}."
    )
    prompt = list(tool_prompt(tokenizer))
    result = interleaved_rollout(
        [prompt],
        ScriptedBackend(tokenizer, [written], None),
        FakeSandbox(),
        tokenizer,
        RolloutSpec(300, [tokenizer.eos_token_id], call_format=ToolCallFormat(tokenizer)),
    )
    assert result.num_tool_calls == [2]
    assert sft[0]["input_ids"] == prompt + result.completion_ids[0]
    assert sft[0]["completion_mask"] == [0] * len(prompt) + result.interpreter_mask[0]


def test_sft_command_refuses_an_unknown_format(tmp_path):
    """`retool-trl sft --call_format xml`: one line, the choices named."""
    from helpers.testing_utils import save_tiny_model
    from retool_trl.cli.sft import build_sft
    from retool_trl.errors import UserError

    data = tmp_path / "t.jsonl"
    data.write_text('{"prompt": "Q:", "completion": "\\\\boxed{1}"}\n')
    model = save_tiny_model(tmp_path / "m", make_char_tokenizer())
    with pytest.raises(UserError, match="call_format.*invalid choice: 'xml'"):
        build_sft(["--model_name_or_path", model, "--dataset_name", str(data), "--call_format", "xml"])
