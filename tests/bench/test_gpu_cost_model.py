"""The GPU cost model behind `bench_async_rollout.py --engine gpu-model`: its ideal schedules, its prefix cache, and
one small run of the real async and barrier loops against it.

These stand for a user reading `gpu_model_*_vs_ideal`: the ideal must be the schedule the costs allow (checked by
hand on a small case), and no loop can beat it (the engine really sleeps its GPU time and spins its host time).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))

from gpu_cost_model import GpuCost, ideal_async, ideal_barrier, prefix_cached, run_gpu_model  # noqa: E402

ONE_SECOND_STEPS = GpuCost(
    "test", decode_s=1.0, decode_per_seq_s=0.0, prefill_per_token_s=0.0, host_s=0.0, host_per_seq_s=0.0
)


def test_ideal_schedules_by_hand():
    """A decodes 2 tokens, runs a 5 s snippet, decodes 1; B decodes 4 and answers. One step a second, whatever the
    batch. Async: A's snippet ends at 2+5=7, its last token at 8. Barrier: round 1 ends with B at 4, waits for A's
    snippet until 9, round 2 takes one step: 10."""
    log = {"A": [(0, 2), (0, 1)], "B": [(0, 4)]}
    latencies = {"A": [5.0], "B": []}
    assert ideal_async(log, latencies, ONE_SECOND_STEPS) == pytest.approx(8.0)
    assert ideal_barrier(log, latencies, ONE_SECOND_STEPS) == pytest.approx(10.0)


def test_prefill_and_host_costs_count_once_per_step():
    """Prefill is paid in the step a request joins; the host cost in every step, with its per-sequence part."""
    cost = GpuCost(
        "test", decode_s=0.0, decode_per_seq_s=0.0, prefill_per_token_s=0.01, host_s=0.5, host_per_seq_s=0.25
    )
    log = {"A": [(100, 1)], "B": [(100, 2)]}
    # step 1: both, 200 prefilled: 0.5 + 0.5 + 2.0; step 2: B alone: 0.5 + 0.25.
    assert ideal_async(log, {"A": [], "B": []}, cost) == pytest.approx(3.75)
    assert ideal_barrier(log, {"A": [], "B": []}, cost) == pytest.approx(3.75)


def test_the_prefix_cache_keeps_whole_blocks_only():
    """vLLM caches whole blocks: a continued turn prefills again the tokens of the last, partly filled block."""
    previous = list(range(40))
    assert prefix_cached(previous, previous + [99] * 5, 16) == 32
    assert prefix_cached(previous, [7] + previous, 16) == 0


def test_the_real_loops_never_beat_their_ideal():
    """A tiny run of the real async and barrier loops, the local sandbox and the model engine: the same outputs
    both ways, and each wall at least its ideal (the engine sleeps its GPU time, snippets sleep their latency)."""
    from retool_trl.sandbox import LocalSandbox

    with LocalSandbox(num_workers=1, timeout_s=5.0, preload=()) as probe:
        if not probe.session().run("print(1)").ok:
            pytest.skip("the local sandbox cannot run cells on this host")
    out = run_gpu_model("qwen2.5-1.5b-h100", batch=6, seed=0, runs=1, scale=0.1, verbose=False)
    assert out["gpu_model_same_outputs"]
    assert out["gpu_model_async_vs_ideal"] >= 0.99 and out["gpu_model_barrier_vs_ideal"] >= 0.99
    assert out["gpu_model_ideal_async_vs_barrier"] > 1.0
    for key in ("gpu_model_async_vs_barrier", "gpu_model_async_vs_ideal", "gpu_model_barrier_vs_ideal"):
        assert out[f"{key}_min"] <= out[key] <= out[f"{key}_max"]
