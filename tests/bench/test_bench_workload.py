"""The async benchmark's workload (`scripts/bench/bench_async_parts.make_workload`) is the straggler workload its
figures claim: a per-turn barrier waits on a different completion at different turns, as in a real GRPO batch, and the
snippet latencies are long-tailed. A workload without that property measures a barrier that costs nothing."""

import hashlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
from bench_async_parts import make_workload  # noqa: E402


def _barrier_over_longest(workload) -> float:
    """Characters of code turns a per-turn barrier waits for (each round's longest turn, summed) over the longest
    completion's own: 1.0 when one completion is the longest at every turn."""
    lengths = [[len(turn) for turn in row["turns"][:-1]] for row in workload]
    rounds = max(map(len, lengths))
    barrier = sum(max(row[i] if i < len(row) else 0 for row in lengths) for i in range(rounds))
    return barrier / max(sum(row) for row in lengths)


def test_long_tailed_turns_make_the_barrier_wait_on_other_completions():
    long_tailed = [_barrier_over_longest(make_workload(32, seed)) for seed in range(10)]
    even = [_barrier_over_longest(make_workload(32, seed, turns="even")) for seed in range(10)]
    assert all(a >= b for a, b in zip(long_tailed, even, strict=True))
    assert sum(long_tailed) / 10 >= 1.4 > 1.2 >= sum(even) / 10
    assert _barrier_over_longest(make_workload(32, 0)) >= 1.5  # the seed the benchmark runs by default


def test_both_turn_modes_share_answers_and_latencies():
    """Only the code turns' lengths differ between the modes, so a comparison of the two measures the turn
    structure, not other snippet latencies."""
    for a, b in zip(make_workload(32, 3), make_workload(32, 3, turns="even"), strict=True):
        assert a["latencies"] == b["latencies"] and a["turns"][-1] == b["turns"][-1]
        assert len(a["turns"]) == len(b["turns"]) and len(set(b["turns"][:-1])) == 1


def test_even_turns_are_the_earlier_workload():
    """`turns="even"` reproduces the workload the benchmark used before turn lengths were drawn per turn (hashes of
    that code's output), so earlier figures stay reproducible."""
    expected = {
        0: "2f2dc3ddcfb9f4e70dbfa82c584bd15ec0930f567ca6b18e9d8462e0a33cceb3",
        1: "1e68d58053b152196d2e4d187852edbb4c990fcb430bc266ec343e86824463fd",
    }
    for seed, digest in expected.items():
        text = json.dumps(make_workload(32, seed, turns="even"), sort_keys=True)
        assert hashlib.sha256(text.encode()).hexdigest() == digest


def test_snippet_latencies_are_long_tailed_and_bad_arguments_refused():
    latencies = [x for row in make_workload(32, 0) for x in row["latencies"]]
    slow = [x for x in latencies if x >= 0.1]
    assert 0 < len(slow) < len(latencies) / 3 and all(x <= 0.3 for x in slow)
    assert sorted(latencies)[len(latencies) // 2] <= 0.01
    with pytest.raises(ValueError, match="turns must be"):
        make_workload(4, 0, turns="uniform")
    with pytest.raises(ValueError, match="kinds must be at least 1"):
        make_workload(4, 0, kinds=0)
