"""Training-stability options of `ReToolConfig` that act on rollouts before TRL scores them.

- GRPO-RoC (rStar2-Agent, arXiv 2508.20722): from an over-sampled group keep `num_generations` completions, the
  correct ones with the fewest tool errors and format problems, the wrong ones at random, in the sampled proportion.
- Loss masks for void-turn filtering (SimpleTIR, arXiv 2509.02479) and for sandbox infrastructure failures.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ..rollout.spec import RolloutResult


def resample_on_correct(correct: Sequence[bool], problems: Sequence[int], keep: int, rng: random.Random) -> list[int]:
    """Indices (sorted) of the `keep` completions of one over-sampled group to train on.

    Args:
        correct: Whether each sampled completion's answer is right.
        problems: Tool errors + format problems of each completion (lower is better).
        keep: Group size to return (TRL's `num_generations`).
        rng: Source of the random choices (ties and wrong completions).
    """
    positives = [i for i, ok in enumerate(correct) if ok]
    negatives = [i for i, ok in enumerate(correct) if not ok]
    n_pos = min(len(positives), round(keep * len(positives) / len(correct)))
    n_pos = max(n_pos, keep - len(negatives))  # not enough wrong ones: fill with right ones
    ranked = sorted(positives, key=lambda i: (problems[i], rng.random()))
    return sorted(ranked[:n_pos] + rng.sample(negatives, keep - n_pos))


def select_rows(result: RolloutResult, indices: Sequence[int]) -> RolloutResult:
    """The rollout restricted to `indices` (per-completion fields only; sandbox latencies are kept whole)."""
    picked = {}
    for name in RolloutResult.__dataclass_fields__:
        values = getattr(result, name)
        per_row = name not in ("exec_seconds",) and values is not None
        picked[name] = [values[i] for i in indices] if per_row else values
    return RolloutResult(**picked)


def dropped_from_loss(result: RolloutResult, filter_void_turns: bool, drop_infra_failures: bool) -> list[bool]:
    """Which completions get an all-zero loss mask."""
    return [
        (filter_void_turns and void > 0) or (drop_infra_failures and failed)
        for void, failed in zip(result.num_void_turns, result.infra_failed, strict=True)
    ]
