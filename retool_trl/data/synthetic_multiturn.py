r"""The synthetic multi-turn task: a sum of three products under a per-cell length budget, so a solution takes two
cells and the second needs a variable the first left in the session; and its cold-start traces, some of which fail
first (`FAILURES`) and then read the error and recover, or give up.

Problems are `Problem`s of the arithmetic task (`synthetic`), split into train and held-out by the same stable hash.
"""

from __future__ import annotations

import random

from datasets import Dataset, DatasetDict

from ..sandbox.cell_limits import cell_too_long_error as sandbox_cell_too_long_error
from .synthetic import DEFAULT_TEST_FRACTION, Problem, draw_distinct, random_number, to_dataset, trace_tags

# A sum of three products, `a*b+c*d+e*f` (3-digit times 2-digit), under a per-cell length budget that no single cell
# solving it fits: the shortest such cell, the bare 20-character expression, is over `MULTITURN_CELL_CHARS`. The
# traces split it as `a=<first two products>` then `print(a+<third product>)`, so the second cell needs a variable
# the first one left in the session.
MULTITURN_KIND = "three_products"
MULTITURN_CELL_CHARS = 16
# How a cold-start trace goes wrong before it answers (see `multiturn_trace`).
FAILURES = ("undefined_name", "too_long", "typo", "wrong_name")


def cell_too_long_error(max_chars: int = MULTITURN_CELL_CHARS) -> str:
    """The interpreter's reply to a cell over the budget (`ReToolConfig.max_cell_chars`)."""
    return sandbox_cell_too_long_error(max_chars)


def sample_multiturn_problem(rng: random.Random) -> Problem:
    """Draws one `a*b+c*d+e*f` problem (`a`, `c`, `e` of 3 digits; `b`, `d`, `f` of 2)."""
    pairs = [(random_number(rng, 3), random_number(rng, 2)) for _ in range(3)]
    expression = "+".join(f"{a}*{b}" for a, b in pairs)
    return Problem(MULTITURN_KIND, expression, sum(a * b for a, b in pairs), 2)


def sample_multiturn_problems(
    n: int, seed: int = 0, split: str | None = "train", test_fraction: float = DEFAULT_TEST_FRACTION
) -> list[Problem]:
    """Draws `n` distinct multi-turn problems of `split` (arguments as in [`sample_problems`])."""
    if split not in ("train", "test", None):
        raise ValueError(f"split must be 'train', 'test' or None, got {split!r}.")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}.")
    rng = random.Random(f"multiturn-{seed}")
    return draw_distinct(n, lambda: sample_multiturn_problem(rng), split, test_fraction, "multi-turn problems")


def make_multiturn_dataset(
    n: int,
    seed: int = 0,
    split: str = "train",
    test_fraction: float = DEFAULT_TEST_FRACTION,
    failing_start: float = 0.0,
    max_cell_chars: int = MULTITURN_CELL_CHARS,
) -> Dataset:
    """`n` multi-turn problems of one side of the split (`"train"` or `"test"`), columns as [`make_splits`]'s.

    Args:
        failing_start (`float`): Share of the problems whose prompt ends with a failing first cell and the
            interpreter's reply ([`multiturn_failing_cell`], the kinds of `FAILURES` in turn), so that RL also
            trains the recovery from a failure the policy itself rarely makes once it has learnt the task.
        max_cell_chars (`int`): The cell budget the failing cells are written for.
    """
    if not 0.0 <= failing_start <= 1.0:
        raise ValueError(f"failing_start must be in [0, 1], got {failing_start}.")
    problems = sample_multiturn_problems(n, seed, split, test_fraction)
    dataset = to_dataset(problems)
    k = round(len(problems) * failing_start)
    if not k:
        return dataset
    starts = [
        multiturn_failing_cell(p, FAILURES[i % len(FAILURES)], max_cell_chars) for i, p in enumerate(problems[:k])
    ]
    prompts = [prompt + start for prompt, start in zip(dataset["prompt"], starts)] + dataset["prompt"][k:]
    return dataset.remove_columns("prompt").add_column("prompt", prompts).select_columns(dataset.column_names)


def make_multiturn_splits(
    n_train: int,
    n_test: int,
    seed: int = 0,
    test_fraction: float = DEFAULT_TEST_FRACTION,
    failing_start: float = 0.0,
) -> DatasetDict:
    """`DatasetDict(train=..., test=...)` of disjoint multi-turn problems (columns as [`make_splits`])."""
    return DatasetDict(
        train=make_multiturn_dataset(n_train, seed, "train", test_fraction, failing_start),
        test=make_multiturn_dataset(n_test, seed + 1, "test", test_fraction),
    )


def multiturn_cells(problem: Problem) -> tuple[str, str]:
    """The two cells of a correct solution: `a=<first two products>` and `print(a+<third product>)`."""
    head, _, last = problem.expression.rpartition("+")
    return f"a={head}", f"print(a+{last})"


def multiturn_trace(
    problem: Problem,
    failure: str | None = None,
    recovers: bool = True,
    max_cell_chars: int = MULTITURN_CELL_CHARS,
    tags=None,
) -> str:
    r"""The completion of a model that solves a multi-turn problem in cells, possibly after a failing cell.

    Each interpreter block holds exactly what the quickstart's interpreter returns: the printed output, nothing
    for an assignment, and for a failing cell the exception's last line only.

    Args:
        problem (`Problem`): A problem from [`sample_multiturn_problem`].
        failure (`str`, *optional*): How the trace goes wrong first, one of `FAILURES`:
            `undefined_name` runs the second cell before the first (`NameError` on `a`); `too_long` puts the whole
            expression in one cell (refused: over the budget); `typo` writes `x` for the second `*` of the first cell
            (`SyntaxError`); `wrong_name` defines `a` and then uses `b` (`NameError`, `a` stays in the session).
        recovers (`bool`): After the failure, write the corrected cell(s) and answer; if False, give up and state
            an answer without computing it (the gold value: a format only, which a small model cannot reproduce).
        max_cell_chars (`int`): The per-cell budget (only the `too_long` failure's error message depends on it).
        tags: As in [`make_sft_traces`].
    """
    if failure is not None and failure not in FAILURES:
        raise ValueError(f"Unknown failure {failure!r}; expected None or one of {FAILURES}.")
    first, second = multiturn_cells(problem)
    result = str(problem.answer)

    def cell(code: str, output: str) -> str:
        return _cell(code, output, tags)

    failing = "" if failure is None else multiturn_failing_cell(problem, failure, max_cell_chars, tags)
    if failure == "wrong_name":  # `a` was defined first: only the use of `b` fails, and `a` stays in the session
        failing = cell(first, "") + failing
    answer = f"\\boxed{{{result}}}"
    if failure is not None and not recovers:
        return failing + answer
    solved = cell(second, f"{result}\n") if failure == "wrong_name" else cell(first, "") + cell(second, f"{result}\n")
    return failing + solved + answer


def _cell(code: str, output: str, tags=None) -> str:
    code_start, code_end, interp_start, interp_end = trace_tags(tags)
    return f"{code_start}{code}{code_end}{interp_start}{output}{interp_end}"


def multiturn_failing_cell(
    problem: Problem, failure: str, max_cell_chars: int = MULTITURN_CELL_CHARS, tags=None
) -> str:
    """The failing cell of a `failure` (one of `FAILURES`) and the interpreter block that answers it, in a session
    where nothing ran before, exactly as [`multiturn_trace`] shows it: `<code>bad</code><interpreter>error
    </interpreter>`. The cell changes no session state (it fails before assigning anything).

    For `wrong_name` it is the use of `b` alone (`NameError`); the trace runs `a=...` before it, which this cell
    does not include.
    """
    first, second = multiturn_cells(problem)
    cells = {
        "undefined_name": (second, "NameError: name 'a' is not defined\n"),
        "too_long": (f"print({problem.expression})", cell_too_long_error(max_cell_chars)),
        "typo": (first[::-1].replace("*", "x", 1)[::-1], "SyntaxError: invalid decimal literal\n"),
        "wrong_name": (second.replace("a", "b", 1), "NameError: name 'b' is not defined\n"),
    }
    if failure not in cells:
        raise ValueError(f"Unknown failure {failure!r}; expected one of {FAILURES}.")
    return _cell(*cells[failure], tags)


def make_multiturn_sft_traces(
    n: int,
    seed: int = 0,
    failure_fraction: float = 0.5,
    recover_fraction: float = 0.6,
    test_fraction: float = DEFAULT_TEST_FRACTION,
    max_cell_chars: int = MULTITURN_CELL_CHARS,
    tags=None,
) -> Dataset:
    """Cold-start traces for the multi-turn task on training-split problems: a `failure_fraction` share starts with
    a failing cell (kinds of `FAILURES` in equal shares), of which a `recover_fraction` share reads the error and
    corrects it while the rest gives up (so RL has recovery to reinforce); the others solve it cleanly in two cells.

    Returns:
        `Dataset` with columns `prompt`, `completion`, `answer`, `kind`, `expression`, `difficulty`, `failure`
        (`""` for none) and `recovers`.
    """
    for name, value in (("failure_fraction", failure_fraction), ("recover_fraction", recover_fraction)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}.")
    problems = sample_multiturn_problems(n, seed, "train", test_fraction)
    rng = random.Random(f"{seed}-multiturn-failures")  # independent of the problem stream
    failures, recovers = [], []
    for _ in problems:
        failures.append(rng.choice(FAILURES) if rng.random() < failure_fraction else None)
        recovers.append(failures[-1] is None or rng.random() < recover_fraction)
    completions = [multiturn_trace(p, f, r, max_cell_chars, tags) for p, f, r in zip(problems, failures, recovers)]
    return to_dataset(
        problems, {"completion": completions, "failure": [f or "" for f in failures], "recovers": recovers}
    )
