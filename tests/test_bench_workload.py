"""The async benchmark's workload (`scripts/bench_async_parts.make_workload`) is the straggler workload its figures
claim: a per-turn barrier waits on a different completion at different turns, as in a real GRPO batch, and the snippet
latencies are long-tailed. A workload without that property measures a barrier that costs nothing."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from bench_async_parts import make_workload  # noqa: E402


def _code_turn_lengths(workload):
    return [[len(turn) for turn in row["turns"][:-1]] for row in workload]


def _barrier_over_longest(lengths) -> float:
    """Characters a per-turn barrier waits for (the longest turn of each round, summed) over the longest completion's
    own characters: 1.0 when one completion is the longest at every turn."""
    rounds = max(map(len, lengths))
    barrier = sum(max(row[i] if i < len(row) else 0 for row in lengths) for i in range(rounds))
    return barrier / max(sum(row) for row in lengths)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_long_tailed_turns_make_the_barrier_wait_on_other_completions(seed):
    workload = make_workload(32, seed)
    lengths = _code_turn_lengths(workload)
    # Within a completion, turn lengths differ (drawn per turn) for at least some completions.
    assert any(len(set(row)) > 1 for row in lengths)
    # The longest turn of some round belongs to another kind than the longest turn of another round.
    rounds = max(map(len, lengths))
    longest_kind = {
        workload[max(range(len(lengths)), key=lambda j: lengths[j][i] if i < len(lengths[j]) else -1)]["kind"]
        for i in range(rounds)
    }
    assert len(longest_kind) >= 2
    assert _barrier_over_longest(lengths) >= 1.2


def test_even_turns_keep_one_length_per_completion():
    lengths = _code_turn_lengths(make_workload(32, 0, turns="even"))
    assert all(len(set(row)) == 1 for row in lengths)
    assert _barrier_over_longest(lengths) < _barrier_over_longest(_code_turn_lengths(make_workload(32, 0)))


def test_snippet_latencies_are_long_tailed_and_unknown_turns_refused():
    latencies = [x for row in make_workload(32, 0) for x in row["latencies"]]
    slow = [x for x in latencies if x >= 0.1]
    assert 0 < len(slow) < len(latencies) / 3 and all(x <= 0.3 for x in slow)
    assert sorted(latencies)[len(latencies) // 2] <= 0.01
    with pytest.raises(ValueError, match="turns must be"):
        make_workload(4, 0, turns="uniform")
