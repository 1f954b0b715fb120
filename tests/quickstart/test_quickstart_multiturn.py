import json
import re

import pytest

from retool_trl.data.synthetic_multiturn import (
    FAILURES,
    MULTITURN_CELL_CHARS,
    cell_too_long_error,
    multiturn_trace,
    sample_multiturn_problems,
)
from retool_trl.quickstart import CompactProgressCallback, run_quickstart
from retool_trl.quickstart.multiturn import CellBudgetSandbox, boxed_accuracy_and_recovery, recovery_rate
from retool_trl.sandbox import ExecResult, build_sandbox

CELL = re.compile(r"<code>(.*?)</code><interpreter>(.*?)</interpreter>", re.DOTALL)


@pytest.fixture(scope="module")
def budget_sandbox():
    sandbox = CellBudgetSandbox(build_sandbox("local", num_workers=1, timeout_s=5.0), MULTITURN_CELL_CHARS)
    yield sandbox
    sandbox.close()


def test_budget_refuses_long_cells_without_running_them(budget_sandbox):
    session = budget_sandbox.session()
    try:
        long_cell = "a=2;b=3;c=4;d=5;e=6"
        assert len(long_cell) > MULTITURN_CELL_CHARS
        results = budget_sandbox.run_many([(session, "a=1"), (session, long_cell), (session, "print(a)")])
        assert [r.ok for r in results] == [True, False, True]
        assert results[1].output == cell_too_long_error() and not results[1].infra_error
        assert results[2].output == "1\n"  # the refused cell never ran: `a` is still 1
        # A failing cell is reported by its exception line only.
        (error,) = budget_sandbox.run_many([(session, "1/0")])
        assert error.output == "ZeroDivisionError: division by zero\n" and not error.ok
    finally:
        session.close()


def test_budget_leaves_infrastructure_failures_alone():
    class Broken:
        def run_many(self, pairs):
            return [ExecResult("SandboxError: worker lost\nline two", False, False, 0.0, infra_error=True)] * len(
                pairs
            )

    (result,) = CellBudgetSandbox(Broken()).run_many([(None, "a=1")])
    assert result.infra_error and result.output == "SandboxError: worker lost\nline two"


@pytest.mark.parametrize("recovers", [True, False])
@pytest.mark.parametrize("failure", [None, *FAILURES])
def test_traces_show_exactly_what_the_interpreter_returns(budget_sandbox, failure, recovers):
    for problem in sample_multiturn_problems(3, seed=5):
        trace = multiturn_trace(problem, failure, recovers)
        cells = CELL.findall(trace)
        session = budget_sandbox.session()
        try:
            results = budget_sandbox.run_many([(session, code) for code, _ in cells])
        finally:
            session.close()
        assert [r.output for r in results] == [shown for _, shown in cells], trace
        errors = sum(not r.ok for r in results)
        assert errors == (failure is not None)
        solved = results[-1].output == f"{problem.answer}\n"
        assert solved == (failure is None or recovers)
        # Solving takes at least two cells: the budget leaves no one-cell solution.
        assert not solved or len(cells) >= 2
        assert trace.endswith(f"\\boxed{{{problem.answer}}}")


def test_recovery_rate_counts_only_completions_with_a_failing_cell():
    records = [
        {"num_tool_errors": 0, "correct": True},
        {"num_tool_errors": 1, "correct": True},
        {"num_tool_errors": 2, "correct": False},
        {"num_tool_errors": 1, "correct": True},
    ]
    assert recovery_rate(records) == (2 / 3, 3)
    assert recovery_rate(records[:1]) == (None, 0)


def test_reward_logs_recovery_of_the_step():
    logged = {}
    completions = ["\\boxed{5}", "\\boxed{4}", "\\boxed{5}"]
    rewards = boxed_accuracy_and_recovery(
        completions,
        ["5", "5", "5"],
        model_text=completions,
        num_tool_errors=[1, 1, 0],
        log_metric=lambda name, value: logged.setdefault(name, value),
    )
    assert rewards == [1.0, -1.0, 1.0]
    assert logged["retool/recovery_rate"] == 0.5 and logged["retool/failing_cell_ratio"] == 2 / 3
    # The log follows correctness, whatever reward values are configured.
    logged.clear()
    rewards = boxed_accuracy_and_recovery(
        completions,
        ["5", "5", "5"],
        model_text=completions,
        num_tool_errors=[1, 1, 0],
        correct_reward=2.0,
        incorrect_reward=0.0,
        log_metric=lambda name, value: logged.setdefault(name, value),
    )
    assert rewards == [2.0, 0.0, 2.0] and logged["retool/recovery_rate"] == 0.5


def test_compact_progress_line():
    logs = {
        "reward": 0.5,
        "rewards/boxed_accuracy_and_recovery/mean": 0.5,
        "retool/code_ratio": 0.984,
        "retool/calls_per_completion": 2.125,
        "retool/recovery_rate": 0.8,
        "loss": 0.01,
        "kl": 0.2,
    }
    assert CompactProgressCallback.summary(logs) == "reward +0.50 | acc 75% | code 98% | calls 2.1 | recovery 80%"


def test_cli_rejects_an_unknown_task(capsys):
    from retool_trl.cli import main

    assert main(["quickstart", "--task", "chess"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--task" in err and "multiturn" in err


def test_multiturn_quickstart_end_to_end(tmp_path, capsys):
    summary = run_quickstart(
        tmp_path / "run",
        task="multiturn",
        max_steps=2,
        prompts_per_step=2,
        num_generations=2,
        num_train=4,
        num_eval=4,
    )
    out = tmp_path / "run"
    written = json.loads((out / "summary.json").read_text())
    assert written == json.loads(json.dumps(summary))
    assert written["settings"]["task"] == "multiturn" and written["task"]["max_cell_chars"] == MULTITURN_CELL_CHARS
    assert written["settings"]["max_completion_length"] == 144  # the task's default, not the arithmetic one
    tool, text = written["tool_rl"], written["text_rl"]
    for key in ("accuracy_before", "accuracy_after"):
        assert 0 <= tool[key] <= 1 and 0 <= text[key] <= 1
    assert tool["calls_per_completion_after"] >= 0 and text["calls_per_completion_after"] == 0
    for key in ("recovery_rate_before", "recovery_rate_after"):
        assert tool[key] is None or 0 <= tool[key] <= 1
    # The recovery probe: one completion per held-out problem, each from a failing first cell (tool run only).
    assert tool["recovery_probe_n"] == 4 and "recovery_probe_n" not in text
    for when in ("before", "after"):
        assert 0 <= tool[f"recovery_probe_{when}"] <= 1
        assert set(tool[f"recovery_probe_by_failure_{when}"]) == set(FAILURES)
        assert len((out / "tool_rl" / f"probe_{when}_samples.jsonl").read_text().splitlines()) == 4
    # The shipped cold start solves in cells, so the untrained tool run already calls code.
    assert tool["calls_per_completion_before"] >= 1
    log = [json.loads(line) for line in (out / "tool_rl" / "log.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in log if "reward" in entry] == [1, 2]
    assert all("retool/calls_per_completion" in entry for entry in log if "reward" in entry)
    assert (out / "quickstart.png").stat().st_size > 10_000
    # The console carries the compact line, not TRL's log dicts.
    captured = capsys.readouterr()
    assert "'completions/mean_length'" not in captured.out + captured.err
    assert "reward " in captured.err and "calls " in captured.err


class _FreshSessionPerCell:
    """A sandbox that forgets everything between cells (what a stateless code tool does)."""

    def __init__(self, sandbox):
        self.sandbox = sandbox

    def session(self):
        return None

    def run_many(self, pairs):
        sessions = [self.sandbox.session() for _ in pairs]
        try:
            return self.sandbox.run_many([(s, code) for s, (_, code) in zip(sessions, pairs)])
        finally:
            for s in sessions:
                s.close()

    def close(self):
        self.sandbox.close()


def test_shipped_model_solves_in_dependent_cells_and_needs_the_session_state():
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from retool_trl.data.synthetic_multiturn import make_multiturn_splits
    from retool_trl.evaluation.scoring import evaluate
    from retool_trl.quickstart import QuickstartArguments, rl_config
    from retool_trl.quickstart.multiturn import MULTITURN_DEFAULTS, MultiturnTask, multiturn_model_path

    path = Path(multiturn_model_path())
    assert sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) < 2 * 2**20
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.dtype == torch.float32  # stored in float16, loaded for training in float32
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    task = MultiturnTask()
    args = QuickstartArguments(task="multiturn", **MULTITURN_DEFAULTS)
    config = rl_config(
        args,
        Path("unused"),
        True,
        max_tool_calls=task.max_tool_calls,
        max_interpreter_output_chars=task.max_interpreter_output_chars,
        generation_kwargs={"do_sample": False},
    )
    problems = make_multiturn_splits(1, 16, seed=3)["test"]
    sandbox = build_sandbox("local", num_workers=1, timeout_s=5.0)
    try:
        with_state = evaluate(
            model,
            tokenizer,
            problems,
            config,
            batch_size=16,
            progress=False,
            sandbox=CellBudgetSandbox(sandbox, task.max_cell_chars),
        )
        without_state = evaluate(
            model,
            tokenizer,
            problems,
            config,
            batch_size=16,
            progress=False,
            sandbox=CellBudgetSandbox(_FreshSessionPerCell(sandbox), task.max_cell_chars),
        )
    finally:
        sandbox.close()
    solved = [r for r in with_state.records if r["correct"]]
    assert len(solved) >= 12, [r["completion"] for r in with_state.records]
    assert all(r["num_tool_calls"] >= 2 for r in solved)
    # The same completions' second cell reads `a` from the first: without the session's state they cannot succeed.
    assert without_state.metrics["avg@1"] <= 0.1
