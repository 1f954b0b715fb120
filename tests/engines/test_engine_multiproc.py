"""Several training processes (`torchrun`, gloo, CPU) whose ranks need different numbers of turns: no hang, no
crash, and the same completions as one process. Engine stage (each launch starts fresh Python processes)."""

import json

import pytest

from helpers.engine_helpers import launch

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def merged_completions(results: list[dict]) -> dict:
    merged = {}
    for result in results:
        for prompt, completions in result["completions"].items():
            merged.setdefault(prompt, []).extend(completions)
    return merged


def test_ddp_ranks_with_different_turns_match_one_process(tmp_path):
    two = launch("ddp", tmp_path / "two", 2)
    one = launch("ddp", tmp_path / "one", 1)
    # Rank 0's completions call code twice (three turns), rank 1's answer at once (one turn).
    assert two[0]["engine_calls"] == [3] and two[1]["engine_calls"] == [1]
    assert merged_completions(two) == merged_completions(one)
    texts = [text for completions in merged_completions(one).values() for text, _ in completions]
    assert sum("<interpreter>31\n</interpreter>" in t for t in texts) == 2  # the code really ran, state kept


def test_colocate_async_two_processes_with_different_turns(tmp_path):
    """Two training processes, each with its own colocated engine, in the async loop (the default): rank 0's
    completions call code (two turns), rank 1's answer at once (one turn). Both finish, with the barrier loop's
    completions."""
    from helpers.engine_helpers import quickstart_dataset

    texts = list(quickstart_dataset(4, seed=1)["prompt"])
    solved = [f"{t}<code>print({t[8:-2]})</code><interpreter>{eval(t[8:-2])}\n</interpreter>" for t in texts[2:]]
    (tmp_path / "prompts.json").write_text(json.dumps([texts[:2], solved]))
    ranks = launch("vllm_colocate", tmp_path, 2)
    assert ranks[0]["turns"]["async"] == [2, 2] and ranks[1]["turns"]["async"] == [1, 1], ranks
    for rank in ranks:
        assert rank["completions"]["async"] == rank["completions"]["barrier"]


def gap(a: list[list[float]], b: list[list[float]]) -> float:
    """Mean absolute difference of two rows-of-log-probs tables."""
    pairs = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    return sum(abs(x - y) for x, y in pairs) / len(pairs)


def test_server_mode_every_rank_samples_from_the_new_weights_after_trls_weight_sync(tmp_path):
    """The documented multi-GPU recipe: `accelerate launch` ranks, one `trl vllm-serve` server, `rollout_mode: async`.
    At a new step TRL's own `sync_weights` runs (rank 0 pushes the weights, here over vLLM's reload API since NCCL
    needs CUDA, then resets the server's prefix cache) through a proxy that, as vLLM routers do, refuses the reset
    while requests run (HTTP 409) and makes the push take 3 s, as a large model's does. Every rank's first tokens
    must come from the new weights: their sampling log-probs match the updated policy's, not the previous one's; no
    request reaches the server before the reset; the reset is accepted. Before the fix rank 1 sent its requests while
    rank 0 was still pushing (old weights), and the reset met them."""
    from helpers.engine_helpers import RefusingProxy, VLLMServer, quickstart_dataset
    from retool_trl.quickstart import model_path

    texts = list(quickstart_dataset(4, seed=1)["prompt"])
    (tmp_path / "prompts.json").write_text(json.dumps([texts[:2], texts[2:]]))
    server = VLLMServer(model_path())
    proxy = RefusingProxy(server.base_url, push_delay_s=3.0)
    try:
        ranks = launch("vllm_server_sync", tmp_path, 2, proxy.url)
    finally:
        proxy.close()
        server.stop()
    [(_, pushed_from, pushed)] = [e for e in proxy.events if e[0] == "push"]
    resets = [e for e in proxy.events if e[0] == "reset"]
    arrivals = [e[1] for e in proxy.events if e[0] == "completions"]
    assert [status for _, _, status in resets] == [200], proxy.events
    assert arrivals and min(arrivals) > resets[0][1] > pushed, proxy.events
    for rank in ranks:
        assert gap(rank["new"], rank["old"]) > 0.25  # the step's update is visible in the log-probs
        assert gap(rank["sampled"], rank["new"]) < 0.05, rank
