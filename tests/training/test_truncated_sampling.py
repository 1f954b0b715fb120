"""Truncated sampling (top_k/top_p/min_p) beside vLLM's importance-sampling correction."""

from __future__ import annotations


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
