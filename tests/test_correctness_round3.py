"""Correctness where users run, round 3: the barrier loop's requests on a server sized as TRL advises, aborted turns
in the barrier loop, evaluation under sandbox failures, importance sampling under truncated sampling, a fleet of
sandbox servers with one down, the all-failed stop, the context limit asked of a failing server, remote read
timeouts, and smaller ones.

Server-side tests run against `VLLMLikeServer` (a real HTTP server applying vLLM's own request checks) through TRL's
real `VLLMClient` and `VLLMGeneration.generate`. Each test failed on the code before its fix (or shows why a finding
is not a defect).
"""

from __future__ import annotations

import types

import pytest
from test_correctness_round2 import run_loop
from test_turn_engines import EOS, TOKENIZER, Script, ids_of
from vllm_like_server import VLLMLikeServer

from retool_trl.rollout import RolloutSpec


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
    import test_correctness_round2
    import trl.generation.vllm_generation as vllm_generation
    from test_correctness_round2 import trl_server_helper

    sent = []
    helper_for = trl_server_helper

    def recording_helper(*args, **kwargs):  # one process: TRL's broadcast hands the payload back as it is
        made = helper_for(*args, **kwargs)
        monkeypatch.setattr(vllm_generation, "broadcast_object_list", lambda xs, from_process=0: sent.append(xs[0]))
        return made

    monkeypatch.setattr(test_correctness_round2, "trl_server_helper", recording_helper)
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


# ------------------------------------------------------------------------- evaluation under sandbox failures
class FailsUnderEval:
    """A sandbox that fails for its own reasons (a lost worker, a service that drops the request) on every call of
    code that prints `7`, retry included, and runs everything else: a sandbox that fails under eval."""

    def __init__(self):
        from retool_trl.testing import FakeSandbox

        self.inner = FakeSandbox()

    def session(self):
        return self.inner.session()

    def run_many(self, pairs):
        from retool_trl.sandbox import ExecResult

        pairs = list(pairs)
        results = self.inner.run_many(pairs)
        lost = ExecResult("SandboxError: the worker was lost", False, False, 0.0, infra_error=True)
        return [lost if "print(7)" in code else result for (_, code), result in zip(pairs, results, strict=True)]

    def close(self):
        pass


def test_eval_leaves_sandbox_failures_out_of_the_scores_and_reports_them(tmp_path, monkeypatch):
    """`retool-trl eval` with a sandbox that fails under eval for one completion (after its retry): every answer of
    the model is right and no snippet of it errs. Before, the failed completion was scored as a wrong answer and a
    tool error (pass@1 0.5, avg@2 0.75, tool_error_rate 1/3) and the report had no field for it. Now it is left out
    of the scores, as training leaves it out of the loss, and counted in a field of its own, in the JSON and the
    table."""
    import json

    from datasets import Dataset

    from retool_trl.config import ReToolConfig
    from retool_trl.evaluation import inference
    from retool_trl.evaluation.scoring import evaluate, write_report
    from retool_trl.testing import ScriptedBackend
    from testing_utils import make_tiny_qwen2

    scripts = [
        "<code>print(7)</code>so \\boxed{7}",  # problem 0, sample 0: the sandbox fails
        "<code>print(3+4)</code>so \\boxed{7}",
        "<code>print(8)</code>so \\boxed{8}",
        "\\boxed{8}",
    ]
    monkeypatch.setattr(inference, "TransformersBackend", lambda *a, **k: ScriptedBackend(TOKENIZER, scripts))
    dataset = Dataset.from_list([{"prompt": "Q7", "answer": "7"}, {"prompt": "Q8", "answer": "8"}])
    args = ReToolConfig(
        output_dir=str(tmp_path),
        bf16=False,
        use_cpu=True,
        max_completion_length=60,
        system_prompt="none",
        report_to="none",
    )
    model = make_tiny_qwen2(TOKENIZER).eval()
    report = evaluate(
        model, TOKENIZER, dataset, args, num_samples=2, batch_size=4, sandbox=FailsUnderEval(), progress=False
    )
    m = report.metrics
    assert [r["infra_failed"] for r in report.records] == [True, False, False, False]
    assert m["pass@1"] == 1.0 and m["avg@2"] == 1.0 and m["pass@2"] == 1.0
    assert m["tool_error_rate"] == 0.0 and m["code_ratio"] == pytest.approx(2 / 3)
    assert m["infra_failed"] == 1 and m["infra_failed_ratio"] == 0.25
    paths = write_report(report, tmp_path / "eval", "results")
    data = json.loads(paths["json"].read_text())
    assert data["num_infra_failed"] == 1 and data["problems"][0]["infra_failed"] == [True, False]
    assert "sandbox failures (unscored)" in paths["markdown"].read_text()


# ------------------------------------------------------------------ importance sampling under truncated sampling
def vllm_config(tmp_path, monkeypatch, **overrides):
    """A `ReToolConfig` with `use_vllm=True`, as where vLLM is installed (this suite runs without it)."""
    import importlib.util

    from retool_trl import ReToolConfig

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a)
    )
    settings = dict(output_dir=str(tmp_path), use_vllm=True, report_to="none", use_cpu=True)
    return ReToolConfig(**{**settings, **overrides})


@pytest.mark.parametrize(
    "sampling",
    [{"top_p": 0.95}, {"top_k": 20}, {"min_p": 0.05}, {"generation_kwargs": {"top_p": 0.9}}],
    ids=["top_p", "top_k", "min_p", "generation_kwargs"],
)
def test_truncated_sampling_with_vllm_importance_sampling_is_refused_in_one_line(tmp_path, monkeypatch, sampling):
    """`top_p < 1`, `top_k > 0` or `min_p > 0` sampling on vLLM with TRL 1.16's importance-sampling correction (on by
    default): vLLM's log-probs are renormalised over the kept tokens (`processed_logprobs`), the trainer's are not,
    so each weight is the kept mass, not a correction (checked on a real distribution below). Before, the run
    trained with biased weights; now the combination is refused in one line that names both fixes."""
    with pytest.raises(ValueError) as error:
        vllm_config(tmp_path, monkeypatch, **sampling)
    message = str(error.value)
    assert "\n" not in message and "vllm_importance_sampling_correction=False" in message and "top_p=1.0" in message
    name = next(iter(sampling if "generation_kwargs" not in sampling else sampling["generation_kwargs"]))
    assert f"{name}=" in message
    # Either fix is accepted; so is truncation without vLLM (no importance weights at all).
    vllm_config(tmp_path, monkeypatch, vllm_importance_sampling_correction=False, **sampling)
    vllm_config(tmp_path, monkeypatch)


def test_the_bias_of_truncated_sampling_is_the_kept_mass():
    """Why it is refused, on a real distribution: the ratio TRL computes (the trainer's full-vocabulary log-prob of
    the sampled token minus vLLM's processed one, renormalised over the top-p set) is log(kept mass) for every kept
    token, whichever was sampled: a constant scaling of the loss, not a correction."""
    import torch

    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3
    full = torch.log_softmax(logits, -1)
    probs, order = full.exp().sort(descending=True)
    kept = order[: int((probs.cumsum(0) < 0.9).sum()) + 1]  # vLLM's top-p set for top_p=0.9
    processed = torch.log_softmax(logits[kept], -1)
    ratio = (full[kept] - processed).exp()
    assert torch.allclose(ratio, full[kept].exp().sum().expand_as(ratio))
    assert 0.89 < ratio[0].item() < 0.95


# ------------------------------------------------------------------- the context limit asked of a failing server
def models_server(replies):
    """An HTTP server answering `GET /v1/models` with `replies` in turn (status, body), the last one for ever."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from testing_utils import reply_json

    asked = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            status, body = replies[min(len(asked), len(replies) - 1)]
            asked.append(self.path)
            reply_json(self, status, body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}", asked


def test_a_failed_answer_about_the_context_limit_is_asked_again_not_kept_as_no_limit(monkeypatch):
    """A vLLM server that answers `/v1/models` with HTTP 503 once (starting up, behind a router that is restarting
    a replica). Before, the error was cached as "no limit" for the whole run: turns were no longer fitted to the
    context and the first full context stopped the run with HTTP 400. Now the question is asked again and the
    server's limit is used; a card that has no limit is the only answer kept as none."""
    from test_correctness_round2 import max_model_len_of

    from retool_trl import trainer

    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(sleep=lambda s: None), raising=False)
    card = {"data": [{"id": "policy", "max_model_len": 4096}]}
    httpd, url, asked = models_server([(503, {"error": "starting"}), (200, card)])
    try:
        assert max_model_len_of(url) == 4096 and len(asked) == 2
    finally:
        httpd.shutdown()
    httpd, url, asked = models_server([(200, {"data": [{"id": "policy"}]})])
    try:
        assert max_model_len_of(url) is None and len(asked) == 1
    finally:
        httpd.shutdown()


def test_a_server_down_for_longer_is_asked_again_at_the_next_rollout(monkeypatch):
    """The server keeps failing for the first rollout: no limit for that one (with a warning), and the next rollout
    asks again and gets it (before: never asked again)."""
    from retool_trl import trainer
    from retool_trl.trainer import ReToolTrainer

    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(sleep=lambda s: None), raising=False)
    card = {"data": [{"id": "policy", "max_model_len": 2048}]}
    httpd, url, asked = models_server([(500, {})] * 3 + [(200, card)])
    view = types.SimpleNamespace(
        use_vllm=True,
        vllm_generation=types.SimpleNamespace(mode="server"),
        args=types.SimpleNamespace(vllm_server_base_url=url),
    )
    try:
        assert ReToolTrainer._engine_max_model_len(view) is None
        assert ReToolTrainer._engine_max_model_len(view) == 2048
        assert ReToolTrainer._engine_max_model_len(view) == 2048 and len(asked) == 4  # known: not asked again
    finally:
        httpd.shutdown()


@pytest.mark.parametrize(
    ("master_addr", "host", "url"),
    [
        ("fd00::12", "0.0.0.0", "http://[fd00::12]:8000"),
        ("10.0.0.7", "0.0.0.0", "http://10.0.0.7:8000"),
        ("fd00::12", "::", "http://[fd00::12]:8000"),
        (None, "::1", "http://[::1]:8000"),
    ],
)
def test_an_ipv6_master_addr_gives_a_valid_server_url(monkeypatch, master_addr, host, url):
    """A cluster whose launcher sets an IPv6 `MASTER_ADDR` (IPv6-only nodes): the server URL puts the address in
    brackets (before: `http://fd00::12:8000`, which httpx reads as host `fd00` with a bad port)."""
    import httpx

    from retool_trl.trainer import _server_url

    if master_addr is None:
        monkeypatch.delenv("MASTER_ADDR", raising=False)
    else:
        monkeypatch.setenv("MASTER_ADDR", master_addr)
    args = types.SimpleNamespace(vllm_server_base_url=None, vllm_server_host=host, vllm_server_port=8000)
    assert _server_url(args) == url
    assert httpx.URL(_server_url(args)).port == 8000


# ---------------------------------------------------------------- the sandbox's start-up probe and all-failed stop
@pytest.fixture
def fusion():
    from fake_sandboxfusion import serve_fake

    yield from serve_fake()


def test_a_fleet_with_one_server_down_starts_on_the_others(fusion, monkeypatch):
    """`sandbox_url` lists two servers and one is down (connection refused). Before, the start-up probe opened one
    session, which hashed to the server that is down, and stopped the run (about one start in two here, 4 and 5 of
    8 trainers in two runs of a real fleet), though the rollout's own retry would have moved to the other server.
    Now the probe, like the rollout, tries another fresh session, placed away from the server found down."""
    from test_no_silent_failure import closed_port

    from retool_trl.sandbox.remote import client as remote_client
    from retool_trl.sandbox.remote import transport
    from retool_trl.sandbox.remote.client import RemoteSandbox
    from retool_trl.training.sandbox_health import SandboxHealth

    down = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setattr(remote_client.zlib, "crc32", lambda data: 0)  # the first session goes to the first server
    monkeypatch.setattr(transport, "_sleep", lambda s: None)
    with RemoteSandbox([down, fusion.url], timeout_s=5.0, retries=1, backoff_s=0.01, sessions="replay") as sandbox:
        health = SandboxHealth("training")
        with health.step(health.watch(sandbox)):
            pass
        assert sandbox._down_until.get(down)  # it did try the server that is down first
        assert len(fusion.requests) >= 1


class FailsFirst:
    """A sandbox that fails its first `n` calls after the probe for its own reasons (a short burst of HTTP 429 from a
    busy service, a retry included), then runs everything; `message` is what the failed calls say."""

    def __init__(self, n: int, message: str = "SandboxError: HTTP 429 (after 4 attempts)"):
        from retool_trl.testing import FakeSandbox

        self.inner, self.left, self.message, self.probes = FakeSandbox(), n, message, 0

    def session(self):
        return self.inner.session()

    def run_many(self, pairs):
        from retool_trl.sandbox import ExecResult

        pairs = list(pairs)
        results = []
        for session, code in pairs:
            if code == "1":
                self.probes += 1
                results += self.inner.run_many([(session, code)])
            elif self.left:
                self.left -= 1
                results.append(ExecResult(self.message, False, False, 0.0, infra_error=True))
            else:
                results += self.inner.run_many([(session, code)])
        return results

    def close(self):
        pass


def rollout_with(health, sandbox, scripts):
    from retool_trl.rollout import interleaved_rollout
    from retool_trl.testing import ScriptedBackend

    spec = RolloutSpec(max_completion_length=60, eos_token_ids=[EOS], max_tool_calls=1)
    prompts = [ids_of("Q:") for _ in scripts]
    watched = health.watch(sandbox)
    with health.step(watched):
        return interleaved_rollout(prompts, ScriptedBackend(TOKENIZER, scripts), watched, TOKENIZER, spec)


def test_one_call_failed_twice_in_a_burst_does_not_stop_the_run():
    """One rank's rollout made one code call, and it failed twice (the call and its retry in a fresh session) in a
    short burst of HTTP 429 from a busy service. Before, "every call of the rollout failed" stopped every rank of the
    job. Now the trivial cell is run again: the sandbox runs code, the run goes on (that completion unscored), and
    the next rollout runs its calls."""
    from retool_trl.training.sandbox_health import SandboxHealth

    health, sandbox = SandboxHealth("training"), FailsFirst(2)
    result = rollout_with(health, sandbox, ["<code>print(1)</code>\\boxed{1}"])
    assert result.infra_failed == [True] and sandbox.probes == 2
    result = rollout_with(health, sandbox, ["<code>print(2)</code>\\boxed{2}"])
    assert result.infra_failed == [False]


@pytest.mark.parametrize("message", ["SandboxError: worker pool lost", ""])
def test_a_sandbox_that_stays_down_still_stops_the_run(message):
    """The sandbox goes down after the probe, for good (every call fails, and the trivial cell too): the run stops
    with the sandbox's reason, also when its failures carry no message (before: an empty message was no reason, and
    the run went on without an interpreter)."""
    from retool_trl.testing import FakeSandbox
    from retool_trl.training.sandbox_health import SandboxHealth, SandboxUnavailableError

    class DownAfterProbe(FakeSandbox):
        def run_many(self, pairs):
            from retool_trl.sandbox import ExecResult

            if not self.batches:
                return super().run_many(pairs)
            self.batches.append(len(pairs))
            return [ExecResult(message, False, False, 0.0, infra_error=True) for _ in pairs]

    with pytest.raises(SandboxUnavailableError) as error:
        rollout_with(SandboxHealth("evaluation"), DownAfterProbe(), ["<code>print(1)</code>\\boxed{1}"])
    text = str(error.value)
    assert "evaluation stops" in text and (message or "without a message") in text and "\n" not in text


def test_eval_probes_the_sandbox_once_not_once_per_chunk(tmp_path, monkeypatch):
    """`retool-trl eval` over several chunks (`batch_size` smaller than the problems x samples): the sandbox is
    probed before the first chunk only (before: once per chunk, one more session and cell each)."""
    from datasets import Dataset

    from retool_trl.config import ReToolConfig
    from retool_trl.evaluation import inference
    from retool_trl.evaluation.scoring import evaluate
    from retool_trl.testing import ScriptedBackend
    from testing_utils import make_tiny_qwen2

    scripts = iter([["<code>print(7)</code>\\boxed{7}"] * n for n in (2, 1)])
    monkeypatch.setattr(inference, "TransformersBackend", lambda *a, **k: ScriptedBackend(TOKENIZER, next(scripts)))
    dataset = Dataset.from_list([{"prompt": f"Q{i}", "answer": "7"} for i in range(3)])
    args = ReToolConfig(
        output_dir=str(tmp_path),
        bf16=False,
        use_cpu=True,
        max_completion_length=40,
        system_prompt="none",
        report_to="none",
    )
    sandbox = FailsFirst(0)
    report = evaluate(
        make_tiny_qwen2(TOKENIZER).eval(), TOKENIZER, dataset, args, batch_size=2, sandbox=sandbox, progress=False
    )
    assert report.metrics["pass@1"] == 1.0 and sandbox.probes == 1


def test_a_stop_during_the_trainers_evaluation_says_evaluation_stops(tmp_path):
    """`trainer.evaluate()` (TRL's eval loop, `eval_strategy: steps`) with a sandbox that went down: the stop names
    evaluation (before: "training stops", in the middle of an evaluation)."""
    from test_no_silent_failure import SCRIPTS, DownAfterProbe

    from retool_trl.training.sandbox_health import SandboxUnavailableError
    from testing_utils import trainer_for

    trainer = trainer_for(tmp_path, SCRIPTS, DownAfterProbe())
    trainer.model.eval()
    with pytest.raises(SandboxUnavailableError, match="so evaluation stops"):
        trainer._generate_and_score_completions([{"prompt": "Q:", "answer": "42"} for _ in range(4)])


# ------------------------------------------------------------------- remote sessions on a busy sandbox server
class BusySessionsServer:
    """A stand-in for `retool-trl sandbox-server` that is busy: `/health` answers at once, a session's cell answers
    after `delay_s` (it waited for a worker before its own time limit started)."""

    def __init__(self, delay_s: float):
        import json
        import threading
        import time
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        from testing_utils import reply_json

        outer = self
        self.delay_s, self.runs = delay_s, 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                reply_json(self, 200, {"status": "ok", "sessions": 1, "running": 64, "max_concurrency": 64})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path == "/sessions":  # the limits asked for, confirmed
                    reply_json(self, 200, {"session_id": "s1", "limits": body})
                    return
                time.sleep(outer.delay_s)
                outer.runs += 1
                output = f"ran {body['code']}\n"
                reply_json(
                    self,
                    200,
                    {
                        "results": [
                            {"output": output, "ok": True, "timed_out": False, "duration_s": 0.1, "infra_error": False}
                        ]
                    },
                )

            def do_DELETE(self):
                reply_json(self, 200, {"closed": True})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_busy_sandbox_servers_late_answer_keeps_the_session_and_the_server(monkeypatch):
    """Two sandbox servers, native sessions; the one a session lives on is busy and answers a cell late (its cells
    waited for a worker), with a cell limit of 0.5 s. Before, the read timeout was the cell's limit + 30 s whatever
    the server's queue: the late answer was lost, the session's state with it (an infrastructure error), and a live
    server was marked down for 30 s, its load moved onto the others. Now the cell is waited for while the server
    answers its `/health`: the answer is the cell's, the server keeps its sessions. The margin is cut to 0.5 s (a
    check every second) and the answer comes 4 s late, four checks in: the old fixed read timeout would have lost
    it, as it lost an answer 32 s late with the shipped 30 s margin."""
    from retool_trl.sandbox.remote import service
    from retool_trl.sandbox.remote.client import RemoteSandbox

    monkeypatch.setattr(service, "_REPLY_MARGIN_S", 0.5)
    busy, other = BusySessionsServer(delay_s=4.0), BusySessionsServer(delay_s=0.0)
    try:
        with RemoteSandbox([busy.url, other.url], timeout_s=0.5, sessions="native") as sandbox:
            session = sandbox.session()
            session.server = busy.url
            [result] = sandbox.run_many([(session, "x = 1")])
            assert result.ok and not result.infra_error and result.output == "ran x = 1\n"
            assert not sandbox._down_until
    finally:
        busy.close()
        other.close()


def test_a_sandbox_server_that_goes_away_mid_cell_ends_the_wait(monkeypatch):
    """The other side of waiting while the server is alive: the server goes away while a cell waits (its `/health`
    no longer answers). The wait ends at the next check with an infrastructure error, and new sessions go to the
    other server."""
    from retool_trl.sandbox.remote import service
    from retool_trl.sandbox.remote.client import RemoteSandbox

    monkeypatch.setattr(service, "_REPLY_MARGIN_S", 0.5)
    gone, other = BusySessionsServer(delay_s=30.0), BusySessionsServer(delay_s=0.0)
    try:
        with RemoteSandbox([gone.url, other.url], timeout_s=0.5, sessions="native") as sandbox:
            session = sandbox.session()
            session.server = gone.url
            import threading
            import time

            threading.Timer(1.5, gone.close).start()
            started = time.monotonic()
            [result] = sandbox.run_many([(session, "x = 1")])
            assert result.infra_error and "does not answer" in result.output
            assert time.monotonic() - started < 10
            assert gone.url in sandbox._down_until and sandbox.session().server == other.url
    finally:
        other.close()


# ------------------------------------------------------------------ stream_interval on older vLLM servers
def test_a_server_that_ignores_stream_interval_gives_the_same_completions(monkeypatch):
    """Not a defect: vLLM reads `stream_interval` per request only in recent releases (vllm-project/vllm#49754; 0.32
    does); a server that predates it (the oldest supported is 0.22) accepts the field as an extra one (its request
    models allow extra fields, logged and ignored) and streams every token. The engine reads a stream of one token
    per chunk the same way: the same ids, masks, log-probs and reward kwargs as from a server that honours it, only
    in more chunks."""
    import test_coalesce

    honoured, server, _ = test_coalesce.rollout(test_coalesce.TEXTS, coalesce=True)
    assert all(body["stream_interval"] > 1000 for body in server.bodies)
    handle = test_coalesce.StreamingServer.handle

    def as_vllm_0_22(self, handler, body):
        body = {k: v for k, v in body.items() if k != "stream_interval"}  # an extra field: ignored
        return handle(self, handler, body)

    monkeypatch.setattr(test_coalesce.StreamingServer, "handle", as_vllm_0_22)
    ignored, _, _ = test_coalesce.rollout(test_coalesce.TEXTS, coalesce=True)
    assert ignored.completion_ids == honoured.completion_ids and ignored.logprobs == honoured.logprobs
    assert ignored.interpreter_mask == honoured.interpreter_mask
    assert ignored.extra_fields() == honoured.extra_fields() and not any(ignored.infra_failed)


# --------------------------------------------------------------- colocated tensor-parallel barrier: padding
class FakeSamplingParams:
    """vLLM's `SamplingParams` as TRL builds it (keyword fields, `clone`)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def clone(self):
        return FakeSamplingParams(**self.__dict__)


class RecordingLLM:
    """A colocated engine that writes `ab` then EOS for every prompt, within each prompt's `max_tokens`, and
    records the tokens it decoded per prompt."""

    def __init__(self):
        self.decoded = []

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        outputs, script = [], ids_of("ab") + [EOS]
        for prompt, p in zip(prompts, params, strict=True):
            ids = script[: p.max_tokens] if prompt["prompt_token_ids"] != [EOS] else [7] * p.max_tokens
            self.decoded.append(len(ids))
            outputs.append(
                types.SimpleNamespace(
                    prompt_token_ids=prompt["prompt_token_ids"],
                    outputs=[types.SimpleNamespace(token_ids=ids, logprobs=None)],
                )
            )
        return outputs


def tp_backend(monkeypatch, partner_rows: int, own_rows_active: bool = True, peft: bool = False, world=None):
    """Rank 0 of a tensor-parallel group of 2 (ranks 0 and 1, of 4), through TRL's own colocate `generate`; the
    group's other rank has `partner_rows` rows; `world` is what the other group (ranks 2, 3) reports."""
    from trl.generation import vllm_generation as trl_vllm

    from retool_trl.rollout.engines.vllm_batched import VLLMBackend

    monkeypatch.setattr(trl_vllm, "SamplingParams", FakeSamplingParams, raising=False)
    partner = [ids_of("Q:")] * partner_rows

    def all_gather_object(out, obj, group=None):
        out[0], out[1] = obj, partner + [[EOS]] * (len(obj) - partner_rows)

    def all_gather(parts, tensor, group=None):  # the group's other rank: its plan, or whether it is active
        parts[0].copy_(tensor)
        plan = [partner_rows, 40 if partner_rows else 0, 0, 0] if tensor.numel() == 4 else [int(partner_rows > 0)]
        parts[1].copy_(torch.tensor(plan, dtype=tensor.dtype))

    import torch

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    monkeypatch.setattr(torch.distributed, "all_gather", all_gather)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 0)

    def gather(tensor):  # the world: this group, then the other group's (still active) ranks
        other = world if world is not None else tensor
        return torch.cat([tensor, tensor, other, other])

    accelerator = types.SimpleNamespace(
        num_processes=4, process_index=0, local_process_index=0, device=torch.device("cpu"), gather=gather
    )
    helper = object.__new__(trl_vllm.VLLMGeneration)
    helper.__dict__.update(
        mode="colocate",
        accelerator=accelerator,
        llm=RecordingLLM(),
        tensor_parallel_size=2,
        tp_group="group 0",
        model=types.SimpleNamespace(peft_config={}) if peft else types.SimpleNamespace(),
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        max_completion_length=40,
        logprobs=None,
        structured_outputs_regex=None,
        generation_kwargs={},
        enable_sleep_mode=False,
    )
    monkeypatch.setattr(trl_vllm, "is_peft_model", lambda model: peft, raising=False)
    return VLLMBackend(helper, TOKENIZER, "</code>", accelerator=accelerator), helper


def test_tensor_parallel_padding_rows_decode_one_token_not_the_whole_budget(monkeypatch):
    """A colocated vLLM engine with `vllm_tensor_parallel_size: 2` in the barrier loop: this rank has 3 rows, the
    other rank of its group 1, so TRL's helper gets 2 padding prompts from it. Before, the padding prompts shared
    the group's `max_tokens` (40) and were decoded in full; now they decode one token, and the real rows are as
    they were."""
    import torch  # noqa: F401 - the fixture patches torch.distributed

    backend, helper = tp_backend(monkeypatch, partner_rows=1)
    outputs = backend.generate_turn([ids_of("Q:")] * 3, [40] * 3, [True] * 3)
    assert [out.token_ids for out in outputs] == [ids_of("ab") + [EOS]] * 3
    decoded = helper.llm.decoded
    assert decoded[:3] == [3, 3, 3] and decoded[3] == 3 and decoded[4:] == [1, 1], decoded


def test_a_tensor_parallel_group_whose_rows_are_done_stops_without_waiting_for_the_world(monkeypatch):
    """Several tensor-parallel groups (4 ranks, groups of 2): this group's rows are all done while the other group
    still generates. Before, "anyone still active" was agreed over the whole world, so this group kept calling
    the engine with padding until the slowest rank anywhere finished; now its own group decides. With PEFT, where
    TRL puts a barrier on every process in each call, the whole world still agrees."""
    import torch

    still = torch.tensor([1])
    backend, _ = tp_backend(monkeypatch, partner_rows=0, world=still)
    assert backend.any_active(False) is False
    backend, _ = tp_backend(monkeypatch, partner_rows=0, world=still, peft=True)
    assert backend.any_active(False) is True


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
