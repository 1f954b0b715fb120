"""Evaluation: scoring of real rollouts, the metrics, the report files, and `evaluate` on a tiny model."""

import json

import pytest
from datasets import Dataset

from helpers.testing_utils import FakeSandbox, ScriptedBackend, make_char_tokenizer, make_tiny_qwen2
from retool_trl.config import ReToolConfig
from retool_trl.evaluation.scoring import EvalReport, compute_metrics, evaluate, score_rollout, write_report
from retool_trl.rollout import RolloutSpec, interleaved_rollout


def record(problem, sample, correct, calls=0, errors=0, length=10, model_tokens=10, truncated=False):
    return dict(
        problem=problem,
        sample=sample,
        correct=correct,
        num_tool_calls=calls,
        num_tool_errors=errors,
        length=length,
        model_tokens=model_tokens,
        truncated=truncated,
    )


def test_metrics_by_hand():
    records = [
        # problem 0: first sample wrong, one of three right
        record(0, 0, False, calls=1, errors=1, length=20, model_tokens=12),
        record(0, 1, True, calls=2, length=30, model_tokens=20),
        record(0, 2, False, truncated=True),
        # problem 1: all right, no code
        record(1, 0, True),
        record(1, 1, True),
        record(1, 2, True),
    ]
    m = compute_metrics(records, num_samples=3)
    assert m["pass@1"] == 0.5
    assert m["avg@3"] == pytest.approx(4 / 6)
    assert m["pass@3"] == 1.0
    assert m["code_ratio"] == pytest.approx(2 / 6)
    assert m["calls_per_answer"] == pytest.approx(3 / 6)
    assert m["tool_error_rate"] == pytest.approx(1 / 3)
    assert m["accuracy_with_code"] == 0.5 and m["accuracy_without_code"] == 0.75
    assert m["mean_length"] == pytest.approx((20 + 30 + 40) / 6)
    assert m["mean_model_tokens"] == pytest.approx((12 + 20 + 40) / 6)
    assert m["truncated_ratio"] == pytest.approx(1 / 6)


def test_score_real_rollout():
    """Scored like the reward: only the model's own final \\boxed{} counts, not one printed by code."""
    tok = make_char_tokenizer()
    scripts = [
        "<code>print(6*7)</code>So \\boxed{42}",  # right, with code
        "\\boxed{41}",  # wrong, no code
        "<code>print('\\\\boxed{42}')</code>done",  # the answer only appears in interpreter output
        "<code>1/0</code>oops \\boxed{42}",  # right despite an error
        "I will think for a very long time " * 4,  # cut by the budget
    ]
    spec = RolloutSpec(max_completion_length=80, eos_token_ids=[tok.eos_token_id])
    prompts = [tok("Q: ", add_special_tokens=False)["input_ids"] for _ in scripts]
    result = interleaved_rollout(prompts, ScriptedBackend(tok, scripts), FakeSandbox(), tok, spec)
    scored = score_rollout(result, ["42"] * len(scripts), eos_token_ids=[tok.eos_token_id])
    assert [r["correct"] for r in scored] == [True, False, False, True, False]
    assert [r["prediction"] for r in scored] == ["42", "41", None, "42", None]
    assert [r["num_tool_calls"] for r in scored] == [1, 0, 1, 1, 0]
    assert [r["num_tool_errors"] for r in scored] == [0, 0, 0, 1, 0]
    assert [r["truncated"] for r in scored] == [False, False, False, False, True]
    assert all(r["model_tokens"] < r["length"] for r, s in zip(scored, scripts) if "<code>" in s)


def test_evaluate_counts_and_report_files(tmp_path):
    tok = make_char_tokenizer()
    model = make_tiny_qwen2(tok).eval()
    dataset = Dataset.from_list([{"prompt": f"What is {i}+1?", "answer": str(i + 1)} for i in range(3)])
    args = ReToolConfig(
        output_dir=str(tmp_path),
        bf16=False,
        use_cpu=True,
        max_completion_length=12,
        system_prompt="none",
        report_to="none",
    )
    report = evaluate(model, tok, dataset, args, num_samples=2, batch_size=4, sandbox=FakeSandbox(), progress=False)
    assert report.num_problems == 3 and report.num_samples == 2 and len(report.records) == 6
    assert sorted((r["problem"], r["sample"]) for r in report.records) == [(p, s) for p in range(3) for s in range(2)]
    assert set(report.metrics) >= {"pass@1", "avg@2", "pass@2", "code_ratio", "calls_per_answer", "mean_length"}
    assert all(r["length"] <= 12 for r in report.records)
    report.meta.update(model="tiny", dataset="local")
    paths = write_report(report, tmp_path / "eval", "aime")
    data = json.loads(paths["json"].read_text())
    assert data["model"] == "tiny" and data["num_completions"] == 6 and len(data["problems"]) == 3
    assert all(len(p["correct"]) == 2 for p in data["problems"])
    assert data["settings"]["max_completion_length"] == 12
    table = paths["markdown"].read_text()
    assert "| pass@1 | avg@2 | pass@2 |" in table and "| tiny | local | 3 | 2 |" in table
    assert len(paths["samples"].read_text().splitlines()) == 6


def test_markdown_of_undefined_metrics():
    """With one sample per problem, the table has one pass@1 column (avg@1 and pass@1 are the same figure)."""
    report = EvalReport(compute_metrics([record(0, 0, True)], 1), 1, 1, [record(0, 0, True)])
    table = report.markdown()
    assert table.splitlines()[0].count("pass@1") == 1 and "avg@1" not in table
    assert "| 1 | 100.0% | 0.0% |" in table
    assert report.metrics["accuracy_with_code"] is None
