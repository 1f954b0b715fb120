"""A call format added from outside the package: one class, registered in this file, and nothing else changed.

The real condition: a user (or a plugin) whose model writes its own markup, here a JSON object between `<json>` tags
that the turn stops at, answered by `<<...>>`. Everything a built-in format gets must follow from the class alone:
the config and the command line accept it, the model is told this format (not the tags'), a GRPO rollout runs its
calls and masks exactly the inserted ids, SFT rewrites traces in it, and an evaluation scores it.
"""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset

from retool_trl import ReToolConfig, ReToolTrainer
from retool_trl.format import Call, SFTTrace, StopFormat, Tags, register_format, unregister_format
from retool_trl.format.convert import trace_cells
from retool_trl.models.tiny import ScriptForcingProcessor, build_char_tokenizer, build_tiny_model, save_tiny_model
from retool_trl.testing import FakeSandbox, ScriptedBackend

TOY_TAGS = Tags("<json>", "</json>", "<<", ">>")


class JsonBlockFormat(StopFormat):
    """`<json>{"code": "..."}</json>`, answered by `<<output>>`."""

    name = "json_block"
    summary = 'a JSON object {"code": ...} between <json> tags, answered by <<...>>'
    writes = '`<json>{"code": "print(6*7)"}</json>`'
    answered_by = "`<<42>>`"
    stops_at = "`</json>`"
    prompts = {
        "retool": 'Run Python by writing <json>{{"code": "..."}}</json>; its output comes back as <<...>>. '
        "End with \\boxed{{answer}}.",
        "retool_concise": 'Python as <json>{{"code": "..."}}</json>. End with \\boxed{{}}.',
    }
    stop = "</json>"
    kept_texts = ("<json>", "</json>", "<<", ">>")
    spans = (("<json>", "</json>"), ("<<", ">>"))
    guarded = ("<json>", "</json>", ">>")

    def calls(self, call_text: str) -> list[Call]:
        start = call_text.rfind("<json>")
        if start < 0:
            return []
        try:
            code = json.loads(call_text[start + len("<json>") : -len(self.stop)])["code"]
        except (ValueError, KeyError, TypeError):
            return [Call(None, 'Error: write <json>{"code": "<python>"}</json>.')]
        return [Call(code)]

    def result_texts(self, outputs):
        return "<<", ">>"

    @classmethod
    def sft_trace(cls, completion: str, tags: Tags = Tags()) -> SFTTrace:
        pieces = []
        for prose, code, output in trace_cells(completion, tags):
            pieces.append(prose)
            if code is not None:
                pieces.append(f"<json>{json.dumps({'code': code})}</json>")
                pieces.append("" if output is None else f"<<{output}>>")
        return SFTTrace(text="".join(pieces), spans=TOY_TAGS)


@pytest.fixture
def toy_format():
    register_format(JsonBlockFormat)
    yield JsonBlockFormat
    unregister_format(JsonBlockFormat.name)


TOKENIZER = build_char_tokenizer()
SCRIPTS = ['Let me run it.<json>{"code": "x = 6 * 7\\nprint(x)"}</json> so \\boxed{42}', "\\boxed{41}"] * 2


def test_the_config_and_the_command_line_take_it_and_tell_the_model_its_format(toy_format):
    from retool_trl.cli.train import parse_train_args

    config = ReToolConfig(output_dir="/tmp/unused", report_to="none", call_format="json_block")
    assert config.resolved_system_prompt.startswith('Run Python by writing <json>{"code": "..."}</json>')
    assert "<code>" not in config.resolved_system_prompt
    _, parsed, _ = parse_train_args(["--output_dir", "/tmp/unused", "--call_format", "json_block"])
    assert parsed.call_format == "json_block"


def test_a_format_unknown_once_it_is_gone():
    with pytest.raises(ValueError, match="call_format must be one of tags, tool_call, markdown, got 'json_block'"):
        ReToolConfig(output_dir="/tmp/unused", report_to="none", call_format="json_block")


def test_a_grpo_step_runs_its_calls_and_masks_exactly_the_inserted_ids(toy_format, tmp_path):
    """A scripted model writes the toy calls through `ReToolTrainer`: the call runs, `<<42\\n>>` is inserted and
    masked, the reward reads the prose outside both, and two optimizer steps move the weights."""
    trainer = ReToolTrainer(
        save_tiny_model(tmp_path / "m", TOKENIZER),
        args=ReToolConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=96,
            report_to="none",
            use_cpu=True,
            bf16=False,
            beta=0.0,
            max_steps=2,
            logging_steps=1,
            system_prompt="none",
            call_format="json_block",
        ),
        train_dataset=Dataset.from_list([{"prompt": "Q:", "answer": "42"}] * 4),
        processing_class=TOKENIZER,
        sandbox=FakeSandbox(),
    )
    trainer._make_generation_backend = lambda model: ScriptedBackend(TOKENIZER, SCRIPTS, JsonBlockFormat.stop)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = trainer._generate_and_score_completions([{"prompt": "Q:", "answer": "42"}] * 4)
    for row, script in enumerate(SCRIPTS):
        ids = batch["completion_ids"][row][batch["completion_mask"][row].bool()].tolist()
        mask = batch["tool_mask"][row][batch["completion_mask"][row].bool()].tolist()
        inserted = TOKENIZER.decode([t for t, m in zip(ids, mask) if not m])
        sampled = TOKENIZER.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True)
        assert inserted == ("<<42\n>>" if "<json>" in script else "")
        assert sampled == script
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["retool/code_ratio"] for entry in logs] == [0.5, 0.5]
    # The last step's figures are its own (the first also holds the batch scored above): +1 and -1 in equal parts.
    assert logs[-1]["rewards/boxed_accuracy/mean"] == 0.0 and logs[-1]["retool/accuracy_with_code"] == 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_sft_rewrites_traces_in_it_and_trains_only_the_models_tokens(toy_format, tmp_path):
    """`retool-trl sft --call_format json_block`: a ReTool-style trace becomes the toy's markup, its result masked."""
    from retool_trl.cli.sft import build_sft

    data = tmp_path / "traces.jsonl"
    trace = {"prompt": "Q:", "completion": "Try <code>print(6*7)</code><interpreter>42\n</interpreter> so \\boxed{42}"}
    data.write_text(json.dumps(trace) + "\n")
    model = save_tiny_model(tmp_path / "m", TOKENIZER)
    trainer = build_sft(
        ["--model_name_or_path", model, "--dataset_name", str(data), "--output_dir", str(tmp_path / "out")]
        + ["--call_format", "json_block", "--report_to", "none", "--use_cpu", "true"]
    )
    row = trainer.train_dataset[0]  # TRL's labels: -100 where the loss does not look
    trained = TOKENIZER.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != -100])
    untrained = TOKENIZER.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label == -100])
    assert trained == 'Try <json>{"code": "print(6*7)"}</json> so \\boxed{42}' + TOKENIZER.eos_token
    assert untrained == "Q:<<42\n>>"


def test_an_evaluation_scores_a_real_model_writing_it(toy_format):
    """`evaluate` with a real tiny model forced to write the toy's calls (every forward pass runs): the calls run
    in the sandbox and the answer after the result is scored; the one printed by code is not."""
    from transformers import LogitsProcessorList

    from retool_trl.evaluation.scoring import evaluate

    scripts = ['<json>{"code": "print(6*7)"}</json> so \\boxed{42}', '<json>{"code": "print(42)"}</json> ok']
    prompts = ["Q1:", "Q2:"]
    turns = {
        tuple(TOKENIZER(p, add_special_tokens=False)["input_ids"]): [
            TOKENIZER(part, add_special_tokens=False)["input_ids"]
            for part in (s[: s.index("</json>") + 7], s[s.index("</json>") + 7 :])
        ]
        for p, s in zip(prompts, scripts)
    }
    model = build_tiny_model(TOKENIZER).eval()
    generate = model.generate

    def forced_generate(*args, logits_processor=None, **kwargs):
        forcing = ScriptForcingProcessor(turns, TOKENIZER, code_end=JsonBlockFormat.stop)
        return generate(*args, logits_processor=LogitsProcessorList([forcing]), **kwargs)

    model.generate = forced_generate
    args = ReToolConfig(
        output_dir="/tmp/unused",
        report_to="none",
        use_cpu=True,
        bf16=False,
        max_completion_length=80,
        system_prompt="none",
        call_format="json_block",
    )
    dataset = Dataset.from_list([{"prompt": p, "answer": "42"} for p in prompts])
    report = evaluate(model, TOKENIZER, dataset, args, batch_size=2, sandbox=FakeSandbox(), progress=False)
    assert [r["num_tool_calls"] for r in report.records] == [1, 1]
    assert [r["correct"] for r in report.records] == [True, False]
    assert report.metrics["code_ratio"] == 1.0
