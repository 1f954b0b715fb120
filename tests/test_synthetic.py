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
    assert all(c.startswith("<py>print(") and "</py><out>" in c and "</out>\\boxed{" in c for c in traces["completion"])
