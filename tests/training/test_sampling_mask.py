"""Sampling-mask replay (`training.sampling_mask`) against an independent computation, and the kept sets' way from
the engine's reply through the rollout (fast, CPU, no vLLM)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from retool_trl.rollout.engines.vllm_colocate import kept_sets
from retool_trl.rollout.engines.vllm_server import _take, _Turn, kept_from_top_logprobs
from retool_trl.rollout.rows import Row
from retool_trl.rollout.turns import EngineError, finish_turn
from retool_trl.rollout.types import TurnOutput
from retool_trl.training import sampling_mask
from retool_trl.training.sampling_mask import (
    LOGPROBS_BOUND,
    ReplaySettings,
    kept_log_mass,
    lift_logprobs,
    ratio_stats,
    replay_settings,
)

VOCAB = 48


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return Qwen2ForCausalLM(config).eval()


def truncated_set(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> list[int]:
    """vLLM's kept set at one position: the top_k tokens, then the smallest prefix holding top_p of their mass."""
    probs = torch.softmax(logits / temperature, -1)
    order = probs.argsort(descending=True)[:top_k]
    kept_probs = probs[order] / probs[order].sum()
    n = int((kept_probs.cumsum(0) < top_p).sum()) + 1
    return order[:n].tolist()


def test_kept_log_mass_matches_a_full_forward_and_a_softmax_over_the_kept_set(model):
    """Rows of different lengths in one padded batch; for each completion token, the independent computation runs
    the row alone and takes the softmax over the kept set: `log p - log S'` must be that renormalised log-prob."""
    g = torch.Generator().manual_seed(1)
    temperature = 0.7
    prompts = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (3, 6, 4)]
    completions = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (5, 2, 7)]
    kept, expected_mass, expected_renorm, full_logp = [], [], [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0].float()
        row_kept, masses, renorm, full = [], [], [], []
        for t, token in enumerate(completion):
            position = logits[len(prompt) + t - 1]
            ids = truncated_set(position, temperature, top_k=8, top_p=0.8)
            if token not in ids:
                ids = [*ids, token]  # the sampled token is always kept
            probs = torch.softmax(position / temperature, -1)
            row_kept.append(ids)
            masses.append(math.log(probs[ids].sum().item()))
            renorm.append(torch.log_softmax(position[ids] / temperature, -1)[ids.index(token)].item())
            full.append(math.log(probs[token].item()))
        row_kept[-1] = None  # a token without a kept set (inserted by the interpreter): no lift
        masses[-1] = 0.0
        kept.append(row_kept)
        expected_mass.append(masses)
        expected_renorm.append(renorm)
        full_logp.append(full)

    got = kept_log_mass(model, prompts, completions, kept, temperature)
    for row, want in zip(got, expected_mass, strict=True):
        assert row == pytest.approx(want, abs=1e-5)
    for row_got, row_full, row_renorm, row_kept in zip(got, full_logp, expected_renorm, kept, strict=True):
        for mass, full, renorm, ids in zip(row_got, row_full, row_renorm, row_kept, strict=True):
            if ids is not None:
                assert full - mass == pytest.approx(renorm, abs=1e-5)
    # In chunks of positions: the same.
    logits = torch.randn(9, VOCAB, generator=g)
    sets = [[1, 2, 3], None, [4], [5, 6], None, [7, 8, 9, 10], [11], [12, 13], [0]]
    assert sampling_mask.log_mass(logits, sets, 0.7, chunk=2) == pytest.approx(
        sampling_mask.log_mass(logits, sets, 0.7, chunk=256), abs=1e-6
    )


def test_the_lift_makes_trls_ratio_the_renormalised_one():
    """TRL's ratio is exp(old - sampling): against lifted sampling log-probs (log q + log S'), it is the trainer's
    renormalised probability over vLLM's; a missing log-prob stays missing (TRL maps it to NaN, ratio 1)."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(2))
    kept = logits.topk(8).indices.tolist()
    full = torch.log_softmax(logits, -1)
    q = torch.log_softmax(logits[kept], -1)  # vLLM's processed log-probs, same weights
    mass = torch.logsumexp(full[kept], -1).item()
    lifted = lift_logprobs([[q[0].item(), None]], [[mass, 0.0]])
    assert lifted[0][1] is None
    assert math.exp(full[kept[0]].item() - lifted[0][0]) == pytest.approx(1.0, abs=1e-6)
    assert math.exp(full[kept[0]].item() - q[0].item()) == pytest.approx(math.exp(mass))  # today's: the kept mass


def test_ratio_stats_count_masked_tokens_only():
    old = torch.log(torch.tensor([[1.0, 0.5, 1.2, 1.0], [1.05, 0.95, 1.0, 3.0]]))
    sampling = torch.zeros_like(old)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    outside, tokens, total = ratio_stats(old, sampling, mask).tolist()
    assert (outside, tokens) == (2, 5)
    assert total == pytest.approx(1.0 + 0.5 + 1.2 + 1.05 + 0.95)
    # Summed in float64: a float32 sum over a step's tokens (millions) loses the digits the mean is read to.
    assert ratio_stats(old, sampling, mask).dtype == torch.float64


def test_a_batch_without_a_sampled_token_is_not_lifted():
    """Every turn aborted: no row has a token the engine sampled, so no kept set; the rows are infra-failed already
    and their log-probs go to TRL as they are. Sampled tokens without kept sets still stop the run."""
    result = SimpleNamespace(sampling_mask=None, interpreter_mask=[[0], [0, 0]], logprobs=[[None], [None, None]])
    assert sampling_mask.lift_to_kept_mass(None, [[1], [1]], result) == [[None], [None, None]]
    result.interpreter_mask = [[0], [1, 0]]
    with pytest.raises(RuntimeError, match="carries no kept sets"):
        sampling_mask.lift_to_kept_mass(None, [[1], [1]], result)


def test_replay_settings_pick_the_engine_mask_or_the_log_probs_within_the_bound():
    assert replay_settings(8, 262, engine_runs=True) == ReplaySettings("engine", 8)
    # vLLM's mask needs a top_k: the vocabulary where the user set none (keeps every token).
    assert replay_settings(0, 262, engine_runs=True) == ReplaySettings("engine", 262)
    assert replay_settings(None, 262, engine_runs=False) == ReplaySettings("logprobs", 262, 262)
    assert replay_settings(20, 151_936, engine_runs=False) == ReplaySettings("logprobs", 20, 20)
    with pytest.raises(ValueError) as error:
        replay_settings(0, 151_936, engine_runs=False)
    assert "\n" not in str(error.value) and f"top_k <= {LOGPROBS_BOUND}" in str(error.value)


def test_replay_is_asked_only_for_truncated_sampling_with_the_correction(monkeypatch):
    monkeypatch.setattr(sampling_mask, "engine_mask_runs", lambda: False)
    args = SimpleNamespace(
        use_vllm=True,
        vllm_mode="colocate",
        rollout_mode="async",
        vllm_tensor_parallel_size=1,
        vllm_importance_sampling_correction=True,
        top_k=0,
        top_p=1.0,
        min_p=None,
        generation_kwargs={},
    )
    assert sampling_mask.replay_source_for(args) is None
    args.generation_kwargs = {"top_p": 0.9}
    assert sampling_mask.replay_source_for(args) == "logprobs"
    monkeypatch.setattr(sampling_mask, "engine_mask_runs", lambda: True)
    assert sampling_mask.replay_source_for(args) == "engine"
    # vLLM's server sends no sampling mask, and TRL's batched `generate` (barrier) passes none on.
    for setting in ({"vllm_mode": "server"}, {"rollout_mode": "barrier"}, {"vllm_tensor_parallel_size": 2}):
        assert sampling_mask.replay_source_for(SimpleNamespace(**{**vars(args), **setting})) == "logprobs"
    args.vllm_importance_sampling_correction = False
    assert sampling_mask.replay_source_for(args) is None


def _logprob(value):
    return SimpleNamespace(logprob=value)


def test_kept_sets_from_the_engine_mask_or_the_finite_processed_log_probs():
    engine = SimpleNamespace(sampling_mask=SimpleNamespace(token_ids=[[3, 5], [7]]), logprobs=None)
    assert kept_sets(engine, "engine") == [[3, 5], [7]]
    assert kept_sets(SimpleNamespace(sampling_mask=None), "engine") is None
    steps = [{3: _logprob(-0.1), 5: _logprob(-2.4), 9: _logprob(-math.inf)}, {7: _logprob(0.0)}]
    assert kept_sets(SimpleNamespace(logprobs=steps), "logprobs") == [[3, 5], [7]]
    assert kept_sets(SimpleNamespace(logprobs=None), "logprobs") is None


class _Chars:
    """A tokenizer of one character per id (enough for `first_stop`)."""

    eos_token_id = 1

    def decode(self, ids, **kwargs):
        return "".join(chr(96 + i) for i in ids)


def test_a_turn_keeps_one_kept_set_per_token_it_keeps():
    ids, kept = [1, 2, 3, 4], [[1], [2, 9], [3], [4]]
    out = finish_turn(ids, [-0.1] * 4, _Chars(), None, [], False, max_tokens=3, kept=kept)
    assert out.token_ids == [1, 2, 3] and out.kept == [[1], [2, 9], [3]]
    with pytest.raises(EngineError, match="sampling masks for 4 tokens"):
        finish_turn(ids, None, _Chars(), None, [], False, max_tokens=4, kept=kept[:3])


@pytest.mark.parametrize("bad", [[], [7, 9]])
def test_a_kept_set_without_its_sampled_token_stops_the_turn(bad):
    """An empty kept set (a server's missing `top_logprobs` entry) or one without the sampled token is not a kept
    set: read as one, the replay would take its mass as 1 (or miss the token's) and the correction would be biased."""
    with pytest.raises(EngineError, match="does not hold the sampled token 2"):
        finish_turn([1, 2], None, _Chars(), None, [], False, max_tokens=2, kept=[[1], bad])
    assert kept_from_top_logprobs([None]) == [[]]  # what the server's reply gives for a missing entry
    with pytest.raises(ValueError, match="empty kept set at position 1"):
        sampling_mask.log_mass(torch.zeros(2, VOCAB), [[1], []])


def test_rows_align_kept_sets_with_the_completion_and_the_interpreter_mask():
    row = Row(prompt_ids=[1])
    row.append([5, 6], 1, [-0.5, -0.2], [[5, 7], [6]])
    row.append([8, 9, 10], 0, None)  # interpreter tokens: no kept set
    row.append([11], 1, [-0.3], None)  # an engine that reported none
    assert row.kept == [[5, 7], [6], None, None, None, None]
    assert len(row.kept) == len(row.completion_ids) == len(row.mask)
    assert TurnOutput([1]).kept is None


def test_kept_sets_from_the_servers_top_log_probs_streamed_or_not():
    """vLLM's server writes a removed token's `-inf` as -9999.0 and, asked with `return_tokens_as_token_ids`, keys
    each top log-prob by `token_id:ID`."""
    tops = [{"token_id:3": -0.1, "token_id:5": -2.4, "token_id:9": -9999.0}, {"token_id:7": 0.0}]
    assert kept_from_top_logprobs(tops) == [[3, 5], [7]]

    class Future:
        result = None

        def done(self):
            return self.result is not None

        def set_result(self, value):
            self.result = value

    turn = _Turn([1], 4, False, {}, Future())
    first = {"index": 0, "token_ids": [3], "logprobs": {"token_logprobs": [-0.1], "top_logprobs": tops[:1]}}
    last = {"index": 0, "token_ids": [7], "logprobs": {"token_logprobs": [0.0], "top_logprobs": tops[1:]}}
    _take([turn], first)
    _take([turn], {**last, "finish_reason": "stop"})
    assert turn.future.result == ([3, 7], [-0.1, 0.0], [[3, 5], [7]])
    # A chunk without top log-probs: no kept sets for the turn (the engine refuses to replay without them).
    bare = _Turn([1], 4, False, {}, Future())
    _take([bare], {"index": 0, "token_ids": [3], "logprobs": {"token_logprobs": [-0.1]}, "finish_reason": "stop"})
    assert bare.future.result[2] is None


class _TopLogprobsHelper:
    """TRL's vLLM helper interface: one 3-token turn per prompt, each token with its top log-probs as TRL returns them
    (rank order, most probable first, so the sampled token is not always first; a removed token `-inf`), recording
    the settings each call was made with."""

    mode = "colocate"

    def __init__(self):
        self.max_completion_length, self.generation_kwargs, self.logprobs = 100, {"top_p": 0.9}, 0
        self.calls = []

    def generate(self, prompts, images, num_generations, profiler=None):
        self.calls.append((dict(self.generation_kwargs), self.logprobs))
        ids = [[5, 6, 7] for _ in prompts]
        logprobs = [[[-0.2, -2.0, -math.inf], [-0.2, -math.inf, -math.inf], [-0.5, -1.0, -1.5]] for _ in prompts]
        token_ids = [[[9, 5, 11], [6, 9, 11], [9, 11, 7]] for _ in prompts]
        return prompts, ids, logprobs, token_ids


def test_the_barrier_backend_reads_kept_sets_from_the_top_log_probs_trl_returns():
    from retool_trl.rollout.engines.vllm_batched import VLLMBackend

    helper = _TopLogprobsHelper()
    backend = VLLMBackend(helper, _Chars(), None, replay=ReplaySettings("logprobs", 3, 3))
    [out] = backend.generate_turn([[1, 2]], [10], [False])
    assert out.token_ids == [5, 6, 7] and out.logprobs == [-2.0, -0.2, -1.5]  # the sampled tokens', not the first
    assert out.kept == [[9, 5], [6], [9, 11, 7]]
    [(kwargs, logprobs)] = helper.calls
    assert kwargs["top_k"] == 3 and logprobs == 3  # asked for during the call...
    assert helper.generation_kwargs == {"top_p": 0.9} and helper.logprobs == 0  # ...and restored after it
    # Without the replay: no kept sets, nothing asked.
    [plain] = VLLMBackend(helper, _Chars(), None).generate_turn([[1, 2]], [10], [False])
    assert plain.kept is None and helper.calls[-1] == ({"top_p": 0.9}, 0)
    assert plain.logprobs == [-2.0, -0.2, -1.5]


def test_the_barrier_backend_refuses_top_log_probs_without_the_sampled_token():
    from retool_trl.rollout.engines.vllm_batched import sampled_logprobs

    assert sampled_logprobs([5], [[-0.1]], None) == [-0.1]  # TRL asked for the sampled token's alone
    with pytest.raises(EngineError, match="sampled token 5 at position 1"):
        sampled_logprobs([6, 5], [[-0.1, -2.0], [-0.3, -0.4]], [[6, 9], [9, 11]])


@pytest.mark.parametrize(
    ("source", "extra"), [("engine", {"return_sampling_mask": True}), ("logprobs", {"max_logprobs": -1}), (None, {})]
)
def test_trls_colocated_llm_is_built_with_the_option_the_replay_needs(monkeypatch, source, extra):
    import trl.generation.vllm_generation as helper_module

    built = []

    def fake_llm(**kwargs):
        built.append(kwargs)

    monkeypatch.setattr(helper_module, "LLM", fake_llm, raising=False)
    with sampling_mask.engine_options(source):
        helper_module.LLM(model="m", logprobs_mode="processed_logprobs")
    assert built == [{"model": "m", "logprobs_mode": "processed_logprobs", **extra}]
    assert helper_module.LLM is fake_llm  # restored


def test_an_engine_that_refuses_the_mask_is_built_for_the_log_probs_instead(monkeypatch):
    """vLLM refuses `return_sampling_mask` (at its config check, before it starts anything) where Model Runner V2 does
    not run: the engine is built without it and the kept sets are read from the top log-probs; any other refusal
    stays the user's to see."""
    import trl.generation.vllm_generation as helper_module

    built = []

    def fake_llm(**kwargs):
        if kwargs.get("model") == "bad":
            raise ValueError("max_model_len is too large")
        if kwargs.get("return_sampling_mask"):
            raise ValueError("Value error, sampling distribution replay requires Model Runner V2")
        built.append(kwargs)

    monkeypatch.setattr(helper_module, "LLM", fake_llm, raising=False)
    with sampling_mask.engine_options("engine") as engine:
        helper_module.LLM(model="m")
    assert engine == {"source": "logprobs"} and built == [{"model": "m", "max_logprobs": -1}]
    with pytest.raises(ValueError, match="too large"), sampling_mask.engine_options("engine") as other:
        helper_module.LLM(model="bad")
    assert other == {"source": "engine"} and len(built) == 1
