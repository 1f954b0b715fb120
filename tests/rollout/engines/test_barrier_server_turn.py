"""The barrier loop's server turn: a few concurrent requests rather than one per row, each row beside the largest
budget that fits it, failures that stay with their row yet reach every process, and the same collective calls on
every process."""

from __future__ import annotations

import types

import pytest

from helpers.scripted_turns import EOS, TOKENIZER, Script, ids_of
from helpers.server_loops import run_loop
from helpers.vllm_like_server import VLLMLikeServer
from retool_trl.rollout.batched import RolloutSpec


# ------------------------------------------------------------- the barrier loop on a server sized as TRL advises
def staggered_rows(n: int):
    """`n` rows whose prompts get shorter as their code gets longer: after the first turn every row has its own
    length and its own budget, as in a GRPO batch of different problems whose completions call code of different
    lengths."""
    longest = 2 * n + 4
    prompts = [ids_of("Q" * (longest - 1 - j) + ":") for j in range(n)]
    texts = [f"<code>print({'1' * (j + 1)})</code>so \\boxed{{{j}}}" for j in range(n)]
    return prompts, texts, longest


def test_barrier_server_turn_needs_a_few_concurrent_requests_not_one_per_row(monkeypatch):
    """A vLLM server started with `--max_model_len` sized as TRL advises (longest prompt + `max_completion_length`),
    16 rows of different prompt and code lengths, through TRL's own server-mode helper. After the first turn every
    row has a different context and budget. Before: the rows were grouped by the budget their context leaves
    (`limit - length`), one request per row (16 for the second turn), sent one after the other. Now the rows go as
    the async engine sends them (the largest own budget left sets a request's, every row with room for it goes
    beside it): a handful of requests, sent at once, every one fitting its prompts, the completions those of the
    async loop."""
    n, completion = 16, 100
    prompts, texts, longest = staggered_rows(n)
    limit = longest + completion
    scripts = {tuple(p): Script(p, t) for p, t in zip(prompts, texts, strict=True)}
    spec = RolloutSpec(max_completion_length=completion, eos_token_ids=[EOS], max_tool_calls=2, max_model_len=limit)
    results = {}
    for loop in ("barrier", "async"):
        server = VLLMLikeServer(scripts, TOKENIZER, max_model_len=limit)
        server.delay_s = 0.2
        try:
            results[loop] = run_loop(loop, server, prompts, spec, monkeypatch)
        finally:
            server.close()
        assert not server.refused, loop
        if loop == "barrier":
            bodies, peak = server.bodies, server.peak
    barrier = results["barrier"]
    assert barrier.num_tool_calls == [1] * n and barrier.num_turns == [2] * n and not any(barrier.infra_failed)
    assert barrier.completion_ids == results["async"].completion_ids
    second_turn = [body for body in bodies if len(body["prompt"][0]) > longest]
    # Halving the rows left each time: at most log2(16) + 1 requests (one per row before).
    assert len(bodies) == 1 + len(second_turn) and len(second_turn) <= 5, len(second_turn)
    assert peak >= 2  # the requests of a turn were generating at once
    for body in bodies:  # every request fits every one of its prompts
        assert all(len(p) + body["max_tokens"] <= limit for p in body["prompt"])


def test_fitting_parts_put_every_row_beside_the_largest_budget_that_fits_it():
    """The rule shared by both loops, against a direct reading of vLLM's check (prompt + max_tokens <= limit): each
    row's request asks at least its own budget, every request fits all its prompts, a limit sized as TRL advises
    (budgets that fit their context) puts equal lengths in one request, and a row that fits nowhere goes alone."""
    from retool_trl.rollout.turns import fitting_parts

    lengths, budgets, limit = [10, 20, 30, 40, 15], [50, 45, 30, 20, 48], 70
    parts = fitting_parts(lengths, budgets, limit)
    assert sorted(i for part in parts for i in part) == list(range(5))
    for part in parts:
        request = max(budgets[i] for i in part)
        assert all(lengths[i] + request <= limit and budgets[i] <= request for i in part)
    assert len(parts) < len(set(budgets))
    assert fitting_parts([10] * 4, [5, 9, 7, 3], 19) == [[0, 1, 2, 3]]
    assert fitting_parts([10, 80], [5, 30], 100) == [[1], [0]]
    assert fitting_parts([10, 20], [5, 30], None) == [[0, 1]]


def test_a_turn_the_server_aborted_in_the_barrier_loop_is_an_engine_failure(monkeypatch):
    """vLLM answers `finish_reason: "abort"` for a request it gave up (a weight update in pause mode, a restart).
    TRL's client drops the finish reason; before, the barrier loop took the aborted turn as a finished (void) turn,
    scored as the model's. Now, read from the reply TRL's client received, it is an engine failure: unscored
    (`infra_failed`), as in the async loop."""
    prompt = ids_of("Q:")
    server = VLLMLikeServer({tuple(prompt): Script(prompt, "ab \\boxed{1}")}, TOKENIZER)
    server.finish_reason = "abort"
    spec = RolloutSpec(max_completion_length=30, eos_token_ids=[EOS], max_tool_calls=1)
    try:
        result = run_loop("barrier", server, [prompt], spec, monkeypatch)
    finally:
        server.close()
    assert result.infra_failed == [True] and result.num_infra_errors == [1] and result.num_void_turns == [0]


@pytest.mark.parametrize("limit", [None, 64])
def test_an_aborted_row_fails_alone_and_the_others_finish(monkeypatch, limit):
    """Two rows, the server aborts only one of them (as vLLM aborts a request whose prompt it could not schedule):
    that row is an engine failure, the other finishes as the model wrote it, with and without a context limit."""
    prompts = [ids_of("Q:"), ids_of("R:")]
    scripts = {tuple(p): Script(p, t) for p, t in zip(prompts, ["ab \\boxed{1}", "cd \\boxed{2}"], strict=True)}
    server = VLLMLikeServer(scripts, TOKENIZER, max_model_len=64)
    server.abort_prompts = [prompts[1]]
    spec = RolloutSpec(max_completion_length=30, eos_token_ids=[EOS], max_tool_calls=1, max_model_len=limit)
    try:
        result = run_loop("barrier", server, prompts, spec, monkeypatch)
    finally:
        server.close()
    assert result.infra_failed == [False, True]
    assert result.model_text[0] == "ab \\boxed{1}" and result.completion_ids[0][-1] == EOS


def test_a_failed_request_in_a_barrier_server_turn_reaches_every_process(monkeypatch):
    """Several processes in server mode: only the main process sends requests (from threads), the others wait in
    TRL's broadcast. A request the server refuses (here: a context limit the trainer was told larger than the
    server's) raised on the main process alone, and the other processes waited in that broadcast until the process
    group's timeout. Now the failure travels in the broadcast itself, and the error is raised after it, naming the
    server's answer (the recorded broadcast is what every other process receives)."""
    import trl.generation.vllm_generation as vllm_generation

    import helpers.server_loops as server_loops
    from helpers.server_loops import trl_server_helper

    sent = []
    helper_for = trl_server_helper

    def recording_helper(*args, **kwargs):  # one process: TRL's broadcast hands the payload back as it is
        made = helper_for(*args, **kwargs)
        monkeypatch.setattr(vllm_generation, "broadcast_object_list", lambda xs, from_process=0: sent.append(xs[0]))
        return made

    monkeypatch.setattr(server_loops, "trl_server_helper", recording_helper)
    prompt = ids_of("Q:")
    server = VLLMLikeServer({tuple(prompt): Script(prompt, "ab \\boxed{1}")}, TOKENIZER, max_model_len=16)
    spec = RolloutSpec(max_completion_length=30, eos_token_ids=[EOS], max_tool_calls=1, max_model_len=64)
    try:
        with pytest.raises(Exception, match="maximum context length"):
            run_loop("barrier", server, [prompt], spec, monkeypatch)
    finally:
        server.close()
    assert server.refused and sent, "the failure was raised before TRL's broadcast: the other processes would wait"
    assert all("maximum context length" in str(ids) for ids in sent[-1][0])


def test_every_process_makes_the_same_collective_calls_in_a_barrier_server_turn():
    """Several training processes on one vLLM server (barrier loop, a context limit): only the main process has
    TRL's client, and each process asked the server for its limit on its own (one may have none). Every process must
    still make the same collective calls in a turn, or the job hangs (two processes under torchrun aborted on the
    first version of the budget exchange, which only the main process made)."""
    import contextlib

    import torch

    from retool_trl.rollout.engines.vllm_batched import VLLMBackend

    def calls_of(main: bool, limit):
        gathered = []

        def gather(local):
            gathered.append(len(local))
            return torch.cat([local, local])

        accelerator = types.SimpleNamespace(
            num_processes=2, process_index=0 if main else 1, is_main_process=main, device=torch.device("cpu")
        )
        accelerator.gather = gather
        helper = types.SimpleNamespace(mode="server", generation_kwargs={}, max_completion_length=40)
        if main:
            helper.vllm_client = object()
        helper.generate = lambda prompts, images, num_generations, profiler=None: (
            prompts,
            [ids_of("ab") + [EOS]] * len(prompts),
            None,
            None,
        )
        backend = VLLMBackend(helper, TOKENIZER, "</code>", accelerator=accelerator, max_model_len=limit)
        backend._server_requests = lambda *a: contextlib.nullcontext()
        backend.generate_turn([ids_of("Q:")] * 2, [30, 20], [True, False])
        return gathered

    assert calls_of(True, 64) == calls_of(False, 64) == calls_of(False, None) == [4, 2]
