"""Evaluation with a sandbox that fails: failed calls stay out of the scores and are reported, the sandbox is probed
once, and a stop during the trainer's evaluation says that evaluation stops."""

from __future__ import annotations

import pytest

from helpers.failing_sandboxes import FailsFirst
from helpers.scripted_turns import TOKENIZER


# ------------------------------------------------------------------------- evaluation under sandbox failures
class FailsUnderEval:
    """A sandbox that fails for its own reasons (a lost worker, a service that drops the request) on every call of
    code that prints `7`, retry included, and runs everything else: a sandbox that fails under eval."""

    def __init__(self):
        from retool_trl.testing import FakeSandbox

        self.inner = FakeSandbox()

    def session(self):
        return self.inner.session()

    def run_many(self, pairs):
        from retool_trl.sandbox import ExecResult

        pairs = list(pairs)
        results = self.inner.run_many(pairs)
        lost = ExecResult("SandboxError: the worker was lost", False, False, 0.0, infra_error=True)
        return [lost if "print(7)" in code else result for (_, code), result in zip(pairs, results, strict=True)]

    def close(self):
        pass


def test_eval_leaves_sandbox_failures_out_of_the_scores_and_reports_them(tmp_path, monkeypatch):
    """`retool-trl eval` with a sandbox that fails under eval for one completion (after its retry): every answer of
    the model is right and no snippet of it errs. Before, the failed completion was scored as a wrong answer and a
    tool error (pass@1 0.5, avg@2 0.75, tool_error_rate 1/3) and the report had no field for it. Now it is left out
    of the scores, as training leaves it out of the loss, and counted in a field of its own, in the JSON and the
    table."""
    import json

    from datasets import Dataset

    from helpers.testing_utils import make_tiny_qwen2
    from retool_trl.config import ReToolConfig
    from retool_trl.evaluation import inference
    from retool_trl.evaluation.scoring import evaluate, write_report
    from retool_trl.testing import ScriptedBackend

    scripts = [
        "<code>print(7)</code>so \\boxed{7}",  # problem 0, sample 0: the sandbox fails
        "<code>print(3+4)</code>so \\boxed{7}",
        "<code>print(8)</code>so \\boxed{8}",
        "\\boxed{8}",
    ]
    monkeypatch.setattr(inference, "TransformersBackend", lambda *a, **k: ScriptedBackend(TOKENIZER, scripts))
    dataset = Dataset.from_list([{"prompt": "Q7", "answer": "7"}, {"prompt": "Q8", "answer": "8"}])
    args = ReToolConfig(
        output_dir=str(tmp_path),
        bf16=False,
        use_cpu=True,
        max_completion_length=60,
        system_prompt="none",
        report_to="none",
    )
    model = make_tiny_qwen2(TOKENIZER).eval()
    report = evaluate(
        model, TOKENIZER, dataset, args, num_samples=2, batch_size=4, sandbox=FailsUnderEval(), progress=False
    )
    m = report.metrics
    assert [r["infra_failed"] for r in report.records] == [True, False, False, False]
    assert m["pass@1"] == 1.0 and m["avg@2"] == 1.0 and m["pass@2"] == 1.0
    assert m["tool_error_rate"] == 0.0 and m["code_ratio"] == pytest.approx(2 / 3)
    assert m["infra_failed"] == 1 and m["infra_failed_ratio"] == 0.25
    paths = write_report(report, tmp_path / "eval", "results")
    data = json.loads(paths["json"].read_text())
    assert data["num_infra_failed"] == 1 and data["problems"][0]["infra_failed"] == [True, False]
    assert "sandbox failures (unscored)" in paths["markdown"].read_text()


def test_eval_probes_the_sandbox_once_not_once_per_chunk(tmp_path, monkeypatch):
    """`retool-trl eval` over several chunks (`batch_size` smaller than the problems x samples): the sandbox is
    probed before the first chunk only (before: once per chunk, one more session and cell each)."""
    from datasets import Dataset

    from helpers.testing_utils import make_tiny_qwen2
    from retool_trl.config import ReToolConfig
    from retool_trl.evaluation import inference
    from retool_trl.evaluation.scoring import evaluate
    from retool_trl.testing import ScriptedBackend

    scripts = iter([["<code>print(7)</code>\\boxed{7}"] * n for n in (2, 1)])
    monkeypatch.setattr(inference, "TransformersBackend", lambda *a, **k: ScriptedBackend(TOKENIZER, next(scripts)))
    dataset = Dataset.from_list([{"prompt": f"Q{i}", "answer": "7"} for i in range(3)])
    args = ReToolConfig(
        output_dir=str(tmp_path),
        bf16=False,
        use_cpu=True,
        max_completion_length=40,
        system_prompt="none",
        report_to="none",
    )
    sandbox = FailsFirst(0)
    report = evaluate(
        make_tiny_qwen2(TOKENIZER).eval(), TOKENIZER, dataset, args, batch_size=2, sandbox=sandbox, progress=False
    )
    assert report.metrics["pass@1"] == 1.0 and sandbox.probes == 1


def test_a_stop_during_the_trainers_evaluation_says_evaluation_stops(tmp_path):
    """`trainer.evaluate()` (TRL's eval loop, `eval_strategy: steps`) with a sandbox that went down: the stop names
    evaluation (before: "training stops", in the middle of an evaluation)."""
    from helpers.failing_sandboxes import SCRIPTS, DownAfterProbe
    from helpers.testing_utils import trainer_for
    from retool_trl.training.sandbox_health import SandboxUnavailableError

    trainer = trainer_for(tmp_path, SCRIPTS, DownAfterProbe())
    trainer.model.eval()
    with pytest.raises(SandboxUnavailableError, match="so evaluation stops"):
        trainer._generate_and_score_completions([{"prompt": "Q:", "answer": "42"} for _ in range(4)])
