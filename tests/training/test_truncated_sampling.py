"""Truncated sampling (top_k/top_p/min_p) beside vLLM's importance-sampling correction: why the plain ratio is biased,
when the combination is accepted (sampling-mask replay, `training.sampling_mask`) and when it is refused."""

from __future__ import annotations

import pytest

from retool_trl import ReToolConfig
from retool_trl.training import sampling_mask


def test_the_bias_of_truncated_sampling_is_the_kept_mass():
    """Why it needs the replay, on a real distribution: the ratio TRL computes (the trainer's full-vocabulary log-prob
    of the sampled token minus vLLM's processed one, renormalised over the top-p set) is log(kept mass) for every kept
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


# ------------------------------------------------------------------ importance sampling under truncated sampling
def vllm_config(tmp_path, monkeypatch, **overrides):
    """A `ReToolConfig` with `use_vllm=True`, as where vLLM is installed (this suite runs without it)."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a)
    )
    settings = dict(output_dir=str(tmp_path), use_vllm=True, report_to="none", use_cpu=True)
    return ReToolConfig(**{**settings, **overrides})


@pytest.mark.parametrize(
    "sampling",
    [{"top_p": 0.95}, {"top_k": 2000}, {"min_p": 0.05}, {"generation_kwargs": {"top_p": 0.9}}],
    ids=["top_p", "top_k_past_the_bound", "min_p", "generation_kwargs"],
)
def test_truncated_sampling_is_refused_in_one_line_where_vllm_has_no_sampling_mask(tmp_path, monkeypatch, sampling):
    """A vLLM without the sampling mask (before 0.28) and no `top_k` within the bound of the log-probs source: the
    kept sets cannot be had, so the combination is refused in one line that names the vLLM release needed and the
    fixes."""
    monkeypatch.setattr(sampling_mask, "vllm_version", lambda: "0.27.1")
    with pytest.raises(ValueError) as error:
        vllm_config(tmp_path, monkeypatch, **sampling)
    message = str(error.value)
    assert "\n" not in message and "vllm_importance_sampling_correction=False" in message
    assert f"vLLM >= {sampling_mask.MASK_VLLM_VERSION}" in message and "installed: 0.27.1" in message
    name = next(iter(sampling if "generation_kwargs" not in sampling else sampling["generation_kwargs"]))
    assert f"{name}=" in message
    # Either fix is accepted; so is truncation without vLLM (no importance weights at all).
    vllm_config(tmp_path, monkeypatch, vllm_importance_sampling_correction=False, **sampling)
    vllm_config(tmp_path, monkeypatch)
    # top_k within the bound: the kept set is read from the top_k processed log-probs, on any vLLM.
    vllm_config(tmp_path, monkeypatch, top_k=20, top_p=0.9)


@pytest.mark.parametrize(
    "sampling", [{"top_p": 0.8}, {"top_k": 8}, {"min_p": 0.05}, {"top_k": 20, "top_p": 0.95}], ids=str
)
def test_truncated_sampling_is_accepted_where_vllm_returns_its_sampling_mask(tmp_path, monkeypatch, sampling):
    monkeypatch.setattr(sampling_mask, "vllm_version", lambda: "0.32.0")
    args = vllm_config(tmp_path, monkeypatch, **sampling)
    assert args.vllm_importance_sampling_correction


@pytest.mark.parametrize(
    "setting",
    [{"rollout_mode": "barrier"}, {"vllm_tensor_parallel_size": 2}, {"vllm_mode": "server"}],
    ids=["barrier", "colocated_tp", "server"],
)
def test_replay_is_accepted_by_every_rollout_and_engine(tmp_path, monkeypatch, setting):
    """The kept sets come with every turn: from the async rollout's colocated engine, from the server's completions,
    and from the top log-probs TRL's batched `generate` returns (the barrier rollout)."""
    monkeypatch.setattr(sampling_mask, "vllm_version", lambda: "0.32.0")
    vllm_config(tmp_path, monkeypatch, top_k=8, **setting)


@pytest.mark.parametrize(
    "setting",
    [{"rollout_mode": "barrier"}, {"vllm_tensor_parallel_size": 2}, {"vllm_mode": "server"}],
    ids=["barrier", "colocated_tp", "server"],
)
@pytest.mark.parametrize("sampling", [{"top_p": 0.9}, {"min_p": 0.05}, {"top_k": 2000}], ids=str)
def test_settings_without_the_engine_mask_refuse_a_top_k_past_the_bound_in_the_config(
    tmp_path, monkeypatch, setting, sampling
):
    """The server, the barrier rollout and tensor parallelism read the kept sets from the top log-probs whatever the
    vLLM: without `top_k` within the bound the config refuses (before any model or engine is loaded), in one line
    that names the setting and the fix."""
    monkeypatch.setattr(sampling_mask, "vllm_version", lambda: "0.32.0")
    with pytest.raises(ValueError) as error:
        vllm_config(tmp_path, monkeypatch, **sampling, **setting)
    message = str(error.value)
    name, value = next(iter(setting.items()))
    assert "\n" not in message and f"{name}={value!r}" in message
    assert (
        f"top_k <= {sampling_mask.LOGPROBS_BOUND}" in message
        and "vllm_importance_sampling_correction=False" in message
    )
    vllm_config(tmp_path, monkeypatch, **{**sampling, "top_k": 8}, **setting)
    vllm_config(tmp_path, monkeypatch, **sampling)  # the async colocated engine has vLLM's mask
