"""How a `tool_call` turn's calls are read, on Qwen's real vocabulary and TRL's shipped templates.

The real conditions: Qwen3 thinks before it answers and may name `<tool_call>` in its thinking; a policy early in
training writes a malformed call beside a valid one; Llama 3.1's template makes `code_interpreter` its built-in
python tool, which the model calls as `<|python_tag|>` + code + `<|eom_id|>` (Llama-3.1-Instruct's generation config
stops at `<|eom_id|>` as at `<|eot_id|>`). Each once went wrong: the marker in the thinking was a counted, failed
call and a final answer was made to go on; the valid call was not run (both "could not be read"); the Llama call
ended the completion silently, no code run and no error counted.
"""

from __future__ import annotations

import copy

import pytest

from helpers.qwen_vocab import qwen_tokenizer, with_template
from retool_trl.format.tool_calls import TOOLS, ToolCallFormat
from retool_trl.rollout.batched import RolloutSpec, interleaved_rollout
from retool_trl.rollout.types import TurnOutput
from retool_trl.testing import FakeSandbox, ScriptedBackend


@pytest.fixture(scope="module")
def qwen():
    return qwen_tokenizer()


def call(code: str, name: str = "code_interpreter") -> str:
    body = '{"name": "' + name + '", "arguments": {"code": "' + code + '"}}'
    return f"<tool_call>\n{body}\n</tool_call>"


def rollout(tokenizer, script, eos_ids=None):
    fmt = ToolCallFormat(tokenizer)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 6*7?"}], tools=TOOLS, add_generation_prompt=True, return_dict=False
    )
    eos_ids = eos_ids or [tokenizer.eos_token_id]
    sandbox = FakeSandbox()
    backend = ScriptedBackend(tokenizer, [script], None, eos_token_ids=eos_ids)
    result = interleaved_rollout(
        [list(prompt)], backend, sandbox, tokenizer, RolloutSpec(400, eos_ids, call_format=fmt)
    )
    inserted = tokenizer.decode([t for t, m in zip(result.completion_ids[0], result.interpreter_mask[0]) if not m])
    return result, inserted, sum(sandbox.batches)


def test_a_marker_inside_the_thinking_is_text(qwen):
    tokenizer = with_template(qwen, "qwen3_training")
    script = "<think>\nNo need for a <tool_call> here.\n</think>\n\nIt is \\boxed{42}.<|im_end|>"
    result, inserted, ran = rollout(tokenizer, script)
    assert (result.num_tool_calls, result.num_tool_errors, result.num_turns, ran) == ([0], [0], [1], 0)
    assert inserted == ""


def test_a_marker_inside_the_thinking_beside_a_real_call(qwen):
    tokenizer = with_template(qwen, "qwen3_training")
    script = f"<think>\nI will use <tool_call> now.\n</think>\n\n{call('print(6 * 7)')}<|im_end|>So \\boxed{{42}}."
    result, inserted, ran = rollout(tokenizer, script)
    assert (result.num_tool_calls, result.num_tool_errors, ran) == ([1], [0], 1)
    assert "42" in inserted


def test_a_valid_call_beside_a_malformed_one_runs(qwen):
    tokenizer = with_template(qwen, "qwen2_5")
    broken = call("print(1").replace('"}}', '"}')  # one closing brace short
    script = f"{call('print(6 * 7)')}\n{broken}<|im_end|>So \\boxed{{42}}."
    result, inserted, ran = rollout(tokenizer, script)
    assert (result.num_tool_calls, result.num_tool_errors, ran) == ([2], [1], 1)
    first, second = inserted.split("</tool_response>")[:2]
    assert "42" in first and "could not be read" in second


def llama(qwen):
    """TRL's Llama 3.1 template on Qwen's ranks with Llama's special tokens (its vocabulary is not on PyPI)."""
    tokenizer = copy.deepcopy(with_template(qwen, "llama3_1"))
    specials = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.eos_token = "<|eot_id|>"
    return tokenizer


@pytest.mark.parametrize(
    "turn",
    [
        "<|python_tag|>print(6 * 7)<|eom_id|>",
        '{"name": "code_interpreter", "parameters": {"code": "print(6 * 7)"}}<|eom_id|>',
        '{"name": "code_interpreter", "parameters": {"code": "print(6 * 7)"}}<|eot_id|>',
        '<|python_tag|>{"name": "code_interpreter", "parameters": {"code": "print(6 * 7)"}}<|eom_id|>',
    ],
)
def test_llama_3_1_builtin_python_tool_calls_run(qwen, turn):
    tokenizer = llama(qwen)
    eos_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|eom_id|>")]
    result, inserted, ran = rollout(tokenizer, turn + "It is \\boxed{42}.", eos_ids)
    assert (result.num_tool_calls, result.num_tool_errors, ran) == ([1], [0], 1)
    assert inserted.startswith("<|start_header_id|>ipython<|end_header_id|>\n\n") and "42" in inserted
    assert result.model_text[0].endswith("It is \\boxed{42}.")


class _StopsAtEveryEos(ScriptedBackend):
    """A scripted policy that runs past `<|eom_id|>` (it knows only the tokenizer's EOS) behind an engine that cuts
    each turn at every EOS id of the model's generation config, as vLLM and `generate` do."""

    def __init__(self, tokenizer, scripts, eos_ids):
        super().__init__(tokenizer, scripts, None)
        self.stops = set(eos_ids)

    def generate_turn(self, sequences, max_new_tokens, stop_at_code_end):
        outputs = super().generate_turn(sequences, max_new_tokens, stop_at_code_end)
        ends = [next((k + 1 for k, t in enumerate(o.token_ids) if t in self.stops), len(o.token_ids)) for o in outputs]
        return [TurnOutput(o.token_ids[:end], o.logprobs[:end]) for o, end in zip(outputs, ends)]


def test_a_script_resumes_where_an_engine_cut_its_turn(qwen):
    """The scripted backend behind a caller that keeps only the start of a turn (an engine's own stop ids): the next
    turn continues the script from the cut, and the built-in call in between runs."""
    tokenizer = llama(qwen)
    eos_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|eom_id|>")]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 6*7?"}], tools=TOOLS, add_generation_prompt=True, return_dict=False
    )
    backend = _StopsAtEveryEos(tokenizer, ["<|python_tag|>print(6 * 7)<|eom_id|>It is \\boxed{42}."], eos_ids)
    sandbox = FakeSandbox()
    spec = RolloutSpec(400, eos_ids, call_format=ToolCallFormat(tokenizer))
    result = interleaved_rollout([list(prompt)], backend, sandbox, tokenizer, spec)
    assert (result.num_tool_calls, result.num_tool_errors, sum(sandbox.batches)) == ([1], [0], 1)
    assert result.model_text[0].endswith("It is \\boxed{42}.") and len(backend.calls) == 2


def test_the_trainers_tokenizer_is_left_as_given(qwen):
    """The format reads calls with TRL's response schema on its own copy: set on the trainer's tokenizer, it made
    TRL decode each completion as one assistant message (the last turn) and was saved with the model."""
    tokenizer = with_template(qwen, "qwen2_5")
    ToolCallFormat(tokenizer)
    assert (
        getattr(tokenizer, "response_schema", None) is None and getattr(tokenizer, "response_template", None) is None
    )


def test_rewards_reading_completions_see_every_turn(qwen, tmp_path):
    """A reward that reads TRL's `completions` (as TRL's own rewards do) gets the whole completion: the answer the
    model wrote before a verifying tool call, the tool's answer and the last turn. TRL once parsed it as one
    assistant message (the format's response schema on the trainer's tokenizer), which kept the last turn only."""
    from datasets import Dataset

    from retool_trl import ReToolConfig, ReToolTrainer
    from retool_trl.models.tiny import build_tiny_model

    tokenizer = with_template(qwen, "qwen2_5")
    script = f"The answer is \\boxed{{42}}. Let me verify.\n{call('print(6 * 7)')}<|im_end|>Verified."
    seen = []

    def answer_in_completion(completions, answer, **kwargs):
        seen.extend(c[0]["content"] for c in completions)
        return [float(f"\\boxed{{{a}}}" in c[0]["content"]) for c, a in zip(completions, answer)]

    args = ReToolConfig(
        output_dir=str(tmp_path),
        call_format="tool_call",
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=160,
        max_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        beta=0.0,
        save_strategy="no",
    )
    rows = [{"prompt": [{"role": "user", "content": "What is 6*7?"}], "answer": "42"}] * 2
    trainer = ReToolTrainer(
        build_tiny_model(tokenizer, hidden_size=16, num_layers=1),
        reward_funcs=[answer_in_completion],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        sandbox=FakeSandbox(),
    )
    trainer._make_generation_backend = lambda model: ScriptedBackend(tokenizer, [script, script], None)
    trainer.train()
    assert len(seen) == 2
    for text in seen:
        assert text.startswith("The answer is \\boxed{42}. Let me verify.") and text.endswith("Verified.")
        assert "<tool_response>\n42\n" in text
