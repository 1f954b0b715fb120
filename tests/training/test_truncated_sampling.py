"""Truncated sampling (top_k/top_p/min_p) beside vLLM's importance-sampling correction: refused, and why."""

from __future__ import annotations

import pytest

from retool_trl import ReToolConfig


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
