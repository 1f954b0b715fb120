import contextlib
import io
import re

import pytest

from retool_trl.data.synthetic import (
    KINDS,
    PROMPT_TEMPLATE,
    is_held_out,
    make_arithmetic_dataset,
    make_sft_traces,
    make_splits,
    sample_problems,
)
from retool_trl.data.synthetic_multiturn import (
    FAILURES,
    MULTITURN_CELL_CHARS,
    make_multiturn_sft_traces,
    make_multiturn_splits,
    multiturn_cells,
    sample_multiturn_problems,
)


def _run_python(code: str) -> str:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        exec(code, {})
    return buffer.getvalue()


@pytest.mark.parametrize("difficulty", [1, 2, 3])
@pytest.mark.parametrize("kind", KINDS)
def test_gold_answers_are_python_evaluation(kind, difficulty):
    dataset = make_arithmetic_dataset(50, seed=3, difficulty=difficulty, kinds=[kind], split=None)
    for row in dataset:
        assert row["kind"] == kind
        assert row["answer"] == str(eval(row["expression"]))  # the expression is our own generated arithmetic
        assert row["prompt"] == PROMPT_TEMPLATE.format(expression=row["expression"])
        assert row["expression"] in row["prompt"]


def test_difficulty_sets_operand_lengths():
    for row in make_arithmetic_dataset(30, seed=0, difficulty=2, kinds=["product"]):
        a, b = row["expression"].split("*")
        assert (len(a), len(b)) == (3, 2)
    for row in make_arithmetic_dataset(30, seed=0, difficulty=3, kinds=["sum"]):
        assert [len(t) for t in row["expression"].split("+")] == [5, 5, 5]
    for row in make_arithmetic_dataset(30, seed=0, difficulty=1, kinds=["mod"]):
        a, b, m = re.fullmatch(r"\((\d+)\*(\d+)\)%(\d+)", row["expression"]).groups()
        assert (len(a), len(b)) == (2, 1) and 11 <= int(m) <= 99


def test_seeded_and_distinct():
    first = make_arithmetic_dataset(200, seed=7)
    assert first["expression"] == make_arithmetic_dataset(200, seed=7)["expression"]
    assert first["expression"] != make_arithmetic_dataset(200, seed=8)["expression"]
    assert len(set(first["expression"])) == 200
    assert set(first["kind"]) == set(KINDS)


def test_splits_are_disjoint_across_seeds_and_sizes():
    splits = make_splits(n_train=400, n_test=100, seed=0)
    train, test = set(splits["train"]["expression"]), set(splits["test"]["expression"])
    assert len(train) == 400 and len(test) == 100
    assert not train & test
    # Membership comes from the expression, so other seeds and sizes cannot leak held-out problems into training.
    other_train = set(make_arithmetic_dataset(2000, seed=99, split="train")["expression"])
    assert not other_train & test
    assert all(is_held_out(e) for e in test) and not any(is_held_out(e) for e in train)


def test_held_out_fraction_is_roughly_test_fraction():
    problems = sample_problems(4000, seed=1, split=None)
    share = sum(is_held_out(p.expression, 0.2) for p in problems) / len(problems)
    assert 0.17 < share < 0.23


def test_mixed_difficulties():
    dataset = make_arithmetic_dataset(300, seed=0, difficulty=[1, 3])
    assert set(dataset["difficulty"]) == {1, 3}


def test_bad_arguments():
    with pytest.raises(ValueError, match="kinds"):
        make_arithmetic_dataset(5, kinds=["division"])
    with pytest.raises(ValueError, match="difficulty"):
        make_arithmetic_dataset(5, difficulty=0)
    with pytest.raises(ValueError, match="split"):
        make_arithmetic_dataset(5, split="validation")
    with pytest.raises(ValueError, match="distinct"):  # only 9*90 difficulty-1 products exist
        make_arithmetic_dataset(2000, difficulty=1, kinds=["product"], split="test")


def test_sft_traces_match_a_real_interpreter():
    traces = make_sft_traces(300, seed=0, code_fraction=0.7)
    assert 0.6 < sum(traces["uses_code"]) / len(traces) < 0.8
    assert not any(is_held_out(e) for e in traces["expression"])
    for row in traces:
        if row["uses_code"]:
            match = re.fullmatch(
                r"<code>(.*)</code><interpreter>(.*)</interpreter>\\boxed\{(.*)\}", row["completion"], re.DOTALL
            )
            assert match, row["completion"]
            code, output, boxed = match.groups()
            assert code == f"print({row['expression']})"
            assert output == _run_python(code)  # exactly what the rollout would splice in
            assert boxed == row["answer"]
        else:
            assert row["completion"] == f"\\boxed{{{row['answer']}}}"


def test_sft_traces_use_configured_tags():
    class Tags:
        code_start, code_end, interpreter_start, interpreter_end = "<py>", "</py>", "<out>", "</out>"

    traces = make_sft_traces(20, seed=0, code_fraction=1.0, tags=Tags())
    assert all(
        c.startswith("<py>print(") and "</py><out>" in c and "</out>\\boxed{" in c for c in traces["completion"]
    )


def test_first_task_draws_are_pinned():
    # The shipped quickstart model and its README numbers rest on these exact draws.
    splits = make_splits(512, 256, seed=0)
    assert splits["train"]["expression"][:3] == ["1663+5242+9376", "5969+8808+6866", "(616*27)%47"]
    assert splits["test"]["expression"][:3] == ["843*13", "1484+8689+1712", "(570*44)%95"]
    assert make_sft_traces(5, seed=0)["uses_code"] == [True, False, True, False, False]


def test_multiturn_problems_need_two_cells_under_the_budget():
    problems = sample_multiturn_problems(200, seed=0, split=None)
    for problem in problems:
        assert problem.answer == eval(problem.expression)  # our own generated arithmetic
        # The shortest single cell that solves it (the bare expression) is over the budget ...
        assert len(problem.expression) > MULTITURN_CELL_CHARS
        first, second = multiturn_cells(problem)
        # ... while the two dependent cells fit, and together compute the answer.
        assert len(first) <= MULTITURN_CELL_CHARS and len(second) <= MULTITURN_CELL_CHARS
        assert _run_python(f"{first}\n{second}") == f"{problem.answer}\n"
    assert len({p.expression for p in problems}) == 200


def test_multiturn_splits_are_disjoint_and_seeded():
    splits = make_multiturn_splits(300, 100, seed=0)
    train, test = set(splits["train"]["expression"]), set(splits["test"]["expression"])
    assert len(train) == 300 and len(test) == 100 and not train & test
    assert all(is_held_out(e) for e in test)
    assert splits["train"]["expression"] == make_multiturn_splits(300, 100, seed=0)["train"]["expression"]
    assert splits["train"]["expression"] != make_multiturn_splits(300, 100, seed=1)["train"]["expression"]


def test_multiturn_sft_trace_mix():
    traces = make_multiturn_sft_traces(2000, seed=0, failure_fraction=0.5, recover_fraction=0.6)
    failing = [r for r in traces if r["failure"]]
    assert 0.45 < len(failing) / len(traces) < 0.55
    assert {r["failure"] for r in failing} == set(FAILURES)
    assert 0.55 < sum(r["recovers"] for r in failing) / len(failing) < 0.65
    assert all(r["recovers"] for r in traces if not r["failure"])
    assert not any(is_held_out(e) for e in traces["expression"])
    for row in traces:
        assert row["completion"].endswith(f"\\boxed{{{row['answer']}}}")
        # A trace that answers after computing shows the answer in the interpreter first; one that gives up never.
        assert (f"<interpreter>{row['answer']}\n</interpreter>" in row["completion"]) == row["recovers"]
    with pytest.raises(ValueError, match="failure_fraction"):
        make_multiturn_sft_traces(5, failure_fraction=1.5)


def test_multiturn_training_prompts_can_start_from_a_failing_cell():
    """The quickstart trains recovery on prompts that end with a failing first cell (as the recovery probe starts):
    the share asked for, each kind of failure in turn, the cell and its reply exactly as a trace shows them."""
    from retool_trl.data.synthetic import Problem
    from retool_trl.data.synthetic_multiturn import FAILURES, make_multiturn_dataset, multiturn_failing_cell

    plain = make_multiturn_dataset(8, seed=3)
    mixed = make_multiturn_dataset(8, seed=3, failing_start=0.5)
    assert mixed.column_names == plain.column_names and mixed["answer"] == plain["answer"]
    for i, (before, after) in enumerate(zip(plain, mixed)):
        if i < 4:
            problem = Problem(before["kind"], before["expression"], int(before["answer"]), before["difficulty"])
            assert after["prompt"] == before["prompt"] + multiturn_failing_cell(problem, FAILURES[i])
        else:
            assert after["prompt"] == before["prompt"]
    with pytest.raises(ValueError, match="failing_start must be in"):
        make_multiturn_dataset(4, failing_start=1.5)
