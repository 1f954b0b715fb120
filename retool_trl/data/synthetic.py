r"""Seeded synthetic arithmetic: problems a tiny model cannot solve in its head but can with one line of Python.

Three kinds of problem, each a Python expression that is also shown verbatim in the prompt, so that a model which
calls the interpreter only has to copy it into `print(...)`:

- `product`: `a*b`, with `a` of `difficulty + 1` digits and `b` of `difficulty` digits;
- `sum`: `a+b+c`, three numbers of `difficulty + 2` digits;
- `mod`: `(a*b)%m`, with `a` and `b` as in `product` and a two-digit modulus.

Train and held-out problems never overlap, whatever the seeds or sizes: a problem belongs to the held-out split when a
stable hash of its expression falls below `test_fraction`. SFT traces are drawn from the training side only. The
multi-turn task (`synthetic_multiturn`) draws, splits and stores its problems with the same helpers.

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


def random_number(rng: random.Random, digits: int) -> int:
    """A number of exactly `digits` digits (no leading zero)."""
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def sample_problem(rng: random.Random, kind: str, difficulty: int) -> Problem:
    """Draws one problem of `kind` at `difficulty` (>= 1) from `rng`."""
    if difficulty < 1:
        raise ValueError(f"difficulty must be >= 1, got {difficulty}.")
    if kind == "product":
        a, b = random_number(rng, difficulty + 1), random_number(rng, difficulty)
        return Problem(kind, f"{a}*{b}", a * b, difficulty)
    if kind == "sum":
        terms = [random_number(rng, difficulty + 2) for _ in range(3)]
        return Problem(kind, "+".join(map(str, terms)), sum(terms), difficulty)
    if kind == "mod":
        a, b = random_number(rng, difficulty + 1), random_number(rng, difficulty)
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
    return draw_distinct(
        n,
        lambda: sample_problem(rng, rng.choice(list(kinds)), rng.choice(levels)),
        split,
        test_fraction,
        f"{split or 'any'} problems at difficulty {difficulty} with kinds {list(kinds)}",
    )


def draw_distinct(n: int, draw, split: str | None, test_fraction: float, what: str) -> list[Problem]:
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


def to_dataset(problems: Sequence[Problem], extra: dict[str, list] | None = None) -> Dataset:
    """The problems as dataset rows (prompt, answer, kind, expression, difficulty), plus the `extra` columns."""
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
    return to_dataset(sample_problems(n, seed, difficulty, kinds, split, test_fraction))


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
    code_start, code_end, interp_start, interp_end = trace_tags(tags)
    result = str(problem.answer)
    return f"{code_start}print({problem.expression}){code_end}{interp_start}{result}\n{interp_end}\\boxed{{{result}}}"


def direct_trace(problem: Problem) -> str:
    r"""The completion of a model that answers without code: `\boxed{answer}`.

    The gold answer is used: the cold start teaches the *format* of a direct answer, and on problems of this size a
    small model cannot reproduce the value, which is exactly what tool-free RL then has to live with.
    """
    return f"\\boxed{{{problem.answer}}}"


def trace_tags(tags) -> tuple[str, str, str, str]:
    """The tags a trace is written in: those of `tags` (e.g. a `ReToolConfig`), or the paper's by default."""
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
    return to_dataset(problems, {"completion": completions, "uses_code": uses_code})
