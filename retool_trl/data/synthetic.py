r"""Seeded synthetic arithmetic: problems a tiny model cannot solve in its head but can with one line of Python.

Three kinds of problem, each a Python expression that is also shown verbatim in the prompt, so that a model which
calls the interpreter only has to copy it into `print(...)`:

- `product`: `a*b`, with `a` of `difficulty + 1` digits and `b` of `difficulty` digits;
- `sum`: `a+b+c`, three numbers of `difficulty + 2` digits;
- `mod`: `(a*b)%m`, with `a` and `b` as in `product` and a two-digit modulus.

Train and held-out problems never overlap, whatever the seeds or sizes: a problem belongs to the held-out split when a
stable hash of its expression falls below `test_fraction`. SFT traces are drawn from the training side only.

Example:

```python
from retool_trl.data.synthetic import make_splits

splits = make_splits(n_train=512, n_test=64, seed=0, difficulty=2)
splits["test"][0]  # {"prompt": "What is 843*13?\n", "answer": "10959", "kind": "product", ...}
```
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

from datasets import Dataset, DatasetDict

from ..sandbox.cell_limits import cell_too_long_error as sandbox_cell_too_long_error

KINDS = ("product", "sum", "mod")
PROMPT_TEMPLATE = "What is {expression}?\n"
DEFAULT_TEST_FRACTION = 0.2


@dataclass(frozen=True)
class Problem:
    """One arithmetic problem.

    Args:
        kind (`str`): One of `KINDS`.
        expression (`str`): Python expression, as shown in the prompt (e.g. `"347*68"`).
        answer (`int`): Its value.
        difficulty (`int`): Difficulty level it was drawn at.
    """

    kind: str
    expression: str
    answer: int
    difficulty: int

    @property
    def prompt(self) -> str:
        return PROMPT_TEMPLATE.format(expression=self.expression)


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def sample_problem(rng: random.Random, kind: str, difficulty: int) -> Problem:
    """Draws one problem of `kind` at `difficulty` (>= 1) from `rng`."""
    if difficulty < 1:
        raise ValueError(f"difficulty must be >= 1, got {difficulty}.")
    if kind == "product":
        a, b = _number(rng, difficulty + 1), _number(rng, difficulty)
        return Problem(kind, f"{a}*{b}", a * b, difficulty)
    if kind == "sum":
        terms = [_number(rng, difficulty + 2) for _ in range(3)]
        return Problem(kind, "+".join(map(str, terms)), sum(terms), difficulty)
    if kind == "mod":
        a, b = _number(rng, difficulty + 1), _number(rng, difficulty)
        m = rng.randint(11, 99)  # at least 11, so that the answer is rarely a digit one can guess
        return Problem(kind, f"({a}*{b})%{m}", (a * b) % m, difficulty)
    raise ValueError(f"Unknown problem kind {kind!r}; expected one of {KINDS}.")


def is_held_out(expression: str, test_fraction: float = DEFAULT_TEST_FRACTION) -> bool:
    """Whether a problem belongs to the held-out split.

    A stable hash (not Python's salted `hash`) of the expression decides, so the split is the same in every process
    and no seed or dataset size can move a problem from one side to the other.
    """
    bucket = int.from_bytes(hashlib.sha256(expression.encode()).digest()[:8], "big") / 2**64
    return bucket < test_fraction


def _as_levels(difficulty: int | Sequence[int]) -> list[int]:
    levels = [difficulty] if isinstance(difficulty, int) else list(difficulty)
    if not levels or any(not isinstance(d, int) or d < 1 for d in levels):
        raise ValueError(f"difficulty must be an int >= 1 or a non-empty list of them, got {difficulty!r}.")
    return levels


def sample_problems(
    n: int,
    seed: int = 0,
    difficulty: int | Sequence[int] = 2,
    kinds: Sequence[str] = KINDS,
    split: str | None = "train",
    test_fraction: float = DEFAULT_TEST_FRACTION,
) -> list[Problem]:
    """Draws `n` distinct problems of the given split.

    Args:
        n (`int`): Number of problems.
        seed (`int`): Seed of the problem stream.
        difficulty (`int` or list of `int`): Difficulty level; with a list, each problem picks one uniformly.
        kinds (list of `str`): Problem kinds to mix (uniformly), a subset of `KINDS`.
        split (`str` or `None`): `"train"`, `"test"` (held-out) or `None` (either).
        test_fraction (`float`): Share of the problem space reserved for the held-out split.
    """
    if split not in ("train", "test", None):
        raise ValueError(f"split must be 'train', 'test' or None, got {split!r}.")
    if not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {kinds!r}.")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}.")
    levels = _as_levels(difficulty)
    rng = random.Random(seed)
    return _draw_distinct(
        n,
        lambda: sample_problem(rng, rng.choice(list(kinds)), rng.choice(levels)),
        split,
        test_fraction,
        f"{split or 'any'} problems at difficulty {difficulty} with kinds {list(kinds)}",
    )


def _draw_distinct(n: int, draw, split: str | None, test_fraction: float, what: str) -> list[Problem]:
    """`n` distinct problems of `split` from repeated `draw()` calls (problems of the other split are skipped)."""
    problems: dict[str, Problem] = {}
    attempts, max_attempts = 0, 100 * n + 1000
    while len(problems) < n:
        attempts += 1
        if attempts > max_attempts:  # a small problem space (e.g. difficulty 1 products) ran out
            raise ValueError(f"Could not draw {n} distinct {what}; ask for fewer or raise the difficulty.")
        problem = draw()
        if split is not None and is_held_out(problem.expression, test_fraction) != (split == "test"):
            continue
        problems.setdefault(problem.expression, problem)
    return list(problems.values())


def _to_dataset(problems: Sequence[Problem], extra: dict[str, list] | None = None) -> Dataset:
    columns = {
        "prompt": [p.prompt for p in problems],
        "answer": [str(p.answer) for p in problems],
        "kind": [p.kind for p in problems],
        "expression": [p.expression for p in problems],
        "difficulty": [p.difficulty for p in problems],
    }
    return Dataset.from_dict({**columns, **(extra or {})})


def make_arithmetic_dataset(
    n: int,
    seed: int = 0,
    difficulty: int | Sequence[int] = 2,
    kinds: Sequence[str] = KINDS,
    split: str | None = "train",
    test_fraction: float = DEFAULT_TEST_FRACTION,
) -> Dataset:
    """A dataset of `n` distinct problems with columns `prompt` (plain text), `answer` (string), `kind`,
    `expression` and `difficulty`. Arguments as in [`sample_problems`]."""
    return _to_dataset(sample_problems(n, seed, difficulty, kinds, split, test_fraction))


def make_splits(
    n_train: int,
    n_test: int,
    seed: int = 0,
    difficulty: int | Sequence[int] = 2,
    kinds: Sequence[str] = KINDS,
    test_fraction: float = DEFAULT_TEST_FRACTION,
) -> DatasetDict:
    """`DatasetDict(train=..., test=...)` of disjoint problems (see [`make_arithmetic_dataset`])."""
    return DatasetDict(
        train=make_arithmetic_dataset(n_train, seed, difficulty, kinds, "train", test_fraction),
        # A different stream for the test side; disjointness itself comes from `is_held_out`.
        test=make_arithmetic_dataset(n_test, seed + 1, difficulty, kinds, "test", test_fraction),
    )


def code_trace(problem: Problem, tags=None) -> str:
    r"""The completion of a model that calls the interpreter once: `<code>print(expr)</code>`, the interpreter block
    exactly as the rollout appends it (`print` output, trailing newline included), then `\boxed{answer}`."""
    code_start, code_end, interp_start, interp_end = _tags(tags)
    result = str(problem.answer)
    return f"{code_start}print({problem.expression}){code_end}{interp_start}{result}\n{interp_end}\\boxed{{{result}}}"


def direct_trace(problem: Problem) -> str:
    r"""The completion of a model that answers without code: `\boxed{answer}`.

    The gold answer is used: the cold start teaches the *format* of a direct answer, and on problems of this size a
    small model cannot reproduce the value, which is exactly what tool-free RL then has to live with.
    """
    return f"\\boxed{{{problem.answer}}}"


def _tags(tags) -> tuple[str, str, str, str]:
    if tags is None:
        return "<code>", "</code>", "<interpreter>", "</interpreter>"
    return tags.code_start, tags.code_end, tags.interpreter_start, tags.interpreter_end


def make_sft_traces(
    n: int,
    seed: int = 0,
    difficulty: int | Sequence[int] = 2,
    kinds: Sequence[str] = KINDS,
    code_fraction: float = 0.7,
    test_fraction: float = DEFAULT_TEST_FRACTION,
    tags=None,
) -> Dataset:
    """Cold-start SFT traces on training-split problems: a `code_fraction` share call the interpreter
    ([`code_trace`]), the rest answer directly ([`direct_trace`]), so the SFT model *sometimes* uses code and RL has a
    choice to reinforce.

    Args:
        n (`int`): Number of traces.
        seed (`int`): Seed of the problem stream and of the code/direct choice.
        difficulty, kinds, test_fraction: As in [`sample_problems`].
        code_fraction (`float`): Share of traces that call the interpreter.
        tags: Object with `code_start`, `code_end`, `interpreter_start`, `interpreter_end` (e.g. a `ReToolConfig`);
            the paper's tags by default.

    Returns:
        `Dataset` with columns `prompt`, `completion`, `answer`, `kind`, `expression`, `difficulty`, `uses_code`.
    """
    if not 0.0 <= code_fraction <= 1.0:
        raise ValueError(f"code_fraction must be in [0, 1], got {code_fraction}.")
    problems = sample_problems(n, seed, difficulty, kinds, "train", test_fraction)
    rng = random.Random(f"{seed}-code-choice")  # independent of the problem stream
    uses_code = [rng.random() < code_fraction for _ in problems]
    completions = [code_trace(p, tags) if c else direct_trace(p) for p, c in zip(problems, uses_code)]
    return _to_dataset(problems, {"completion": completions, "uses_code": uses_code})


# ------------------------------------------------------------------------------------------- the multi-turn task
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
    pairs = [(_number(rng, 3), _number(rng, 2)) for _ in range(3)]
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
    return _draw_distinct(n, lambda: sample_multiturn_problem(rng), split, test_fraction, "multi-turn problems")


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
    dataset = _to_dataset(problems)
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
    code_start, code_end, interp_start, interp_end = _tags(tags)
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
    return _to_dataset(
        problems, {"completion": completions, "failure": [f or "" for f in failures], "recovers": recovers}
    )
