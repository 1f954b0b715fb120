"""Text format helpers and the default reward."""

import pytest

from retool_trl.format.parsing import Tags, extract_code, last_boxed, model_prose, remove_spans
from retool_trl.rewards.functions import boxed_accuracy, final_answer, is_equivalent


@pytest.mark.parametrize(
    "turn, code",
    [
        ("think <code>print(1)</code>", "print(1)"),
        ("<code>```python\nx = 2\nprint(x)\n```</code>\n", "x = 2\nprint(x)"),
        ("<code>a</code> then <code>b</code>", "a"),  # the block closed by the first code-end tag
        ("<code>old <code>new</code>", "new"),
        ("no open tag</code>", None),
        ("<code>never closed", None),
        ("", None),
    ],
)
def test_extract_code(turn, code):
    assert extract_code(turn) == code


def test_custom_tags():
    tags = Tags("[PY]", "[/PY]", "[OUT]", "[/OUT]")
    assert extract_code("x [PY]print(3)[/PY]", tags) == "print(3)"
    assert model_prose("a [PY]c[/PY] [OUT]\\boxed{9}[/OUT] b", tags) == "a   b"


def test_model_prose_drops_code_and_interpreter_output():
    text = "Let <code>print('\\boxed{1}')</code><interpreter>\\boxed{1}</interpreter> so \\boxed{2}<code>unclosed"
    assert model_prose(text) == "Let  so \\boxed{2}"
    assert remove_spans("a<x>b</x>c<x>d", "<x>", "</x>") == "ac"


@pytest.mark.parametrize(
    "text, boxed",
    [
        ("\\boxed{42}", "42"),
        ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed {x^{2}}", "x^{2}"),
        ("\\fbox{7}", "7"),
        ("\\boxed{unbalanced", None),
        ("nothing", None),
    ],
)
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(
    "pred, gold, ok",
    [
        ("42", "42", True),
        ("\\frac{1}{2}", "0.5", True),
        ("1/2", "\\frac12", True),
        ("41", "42", False),
        (None, "1", False),
        ("2\\sqrt{2}", "\\sqrt{8}", True),
    ],
)
def test_is_equivalent(pred, gold, ok):
    assert is_equivalent(pred, gold) is ok


def test_boxed_accuracy_counts_only_the_models_own_answer():
    completions = [
        "<code>print(6*7)</code><interpreter>42\n</interpreter> so \\boxed{42}",
        "<code>print('\\\\boxed{42}')</code><interpreter>\\boxed{42}\n</interpreter>",
        [{"role": "assistant", "content": "\\boxed{42}"}],
        "\\boxed{43}",
    ]
    assert boxed_accuracy(completions, ["42"] * 4) == [1.0, -1.0, 1.0, -1.0]
    # model_text (from the rollout) wins over the completion text
    assert boxed_accuracy(["\\boxed{1}"], ["42"], model_text=["\\boxed{42}"]) == [1.0]
    assert boxed_accuracy(["\\boxed{1}", "\\boxed{2}"], ["1"] * 2, correct_reward=2.0, incorrect_reward=0.0) == [
        2.0,
        0.0,
    ]


def test_boxed_accuracy_logs_accuracy_with_and_without_code():
    logged = {}
    boxed_accuracy(
        ["\\boxed{1}", "\\boxed{2}", "\\boxed{1}"],
        ["1", "1", "1"],
        num_tool_calls=[1, 1, 0],
        log_metric=logged.__setitem__,
    )
    assert logged == {
        "retool/accuracy": 2 / 3,
        "retool/accuracy_with_code": 0.5,
        "retool/accuracy_without_code": 1.0,
    }


def test_final_answer_of_truncated_code_is_none():
    assert final_answer("so <code>print('\\\\boxed{3}')") is None


@pytest.mark.parametrize(
    "block",
    [
        "\n    x = 6 * 7\n    print(x)\n",  # indented under a list item
        "\n  ```python\n  x = 6 * 7\n  print(x)\n  ```\n",  # an indented fence
        "```python\r\nx = 6 * 7\r\nprint(x)\r\n```",  # Windows line endings
        "\r\nx = 6 * 7\r\nif x:\r\n    print(x)\r\n",
        "```py\nx = 6 * 7\nprint(x)\n```",
        "```py3\nx = 6 * 7\nprint(x)\n```",
        "```Python3\nx = 6 * 7\nprint(x)\n```",
    ],
)
def test_code_blocks_as_models_write_them_run(block, capsys):
    """Python itself is the judge: the extracted code compiles and prints 42, as the model meant."""
    code = extract_code(f"Let me compute.<code>{block}</code>")
    exec(compile(code, "<cell>", "exec"), {})
    assert capsys.readouterr().out == "42\n"
