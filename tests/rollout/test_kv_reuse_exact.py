"""Every token the transformers backend samples comes from the policy's logits for exactly its context.

The truth is one plain forward pass of the model over `prompt + completion` (no padding, no cache): its logits at
position `t` are what sampling token `t + 1` should have used. Each step of every `generate` call is recorded (the raw
scores, before any warper) and compared with that forward, over the cases that exercise the kept KV cache: stray
code-end tags and `<code lang=..>` (turns that add no interpreter tokens), rows dropped mid-batch, interpreter blocks
of different lengths, prompts of different lengths (left padding), and greedy and sampled decoding.
"""

import pytest
import torch

from helpers.kv_exactness import check_sampled_logits
from helpers.testing_utils import make_char_tokenizer, make_tiny_qwen2


def exactly(scores, truth, where):
    torch.testing.assert_close(scores, truth, rtol=1e-6, atol=1e-6, msg=lambda m: f"{where}: {m}")


@pytest.mark.parametrize(
    "sampling",
    [dict(do_sample=False), dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)],
    ids=["greedy", "sampled"],
)
@pytest.mark.parametrize("reuse_cache", [True, False], ids=["reuse", "no-reuse"])
def test_every_sampled_token_matches_a_full_forward(sampling, reuse_cache):
    tokenizer = make_char_tokenizer()
    # float64 (generate casts the scores to fp32): the truth and the cached steps agree to fp32 rounding.
    model = make_tiny_qwen2(tokenizer, seed=5).double().eval()
    check_sampled_logits(model, tokenizer, sampling, reuse_cache, exactly)
