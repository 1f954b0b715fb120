"""The transformers backend's KV cache across turns: reused on the next turn, and a fallback where reuse would not be
exact."""

import pytest
from transformers import GenerationConfig

from helpers.testing_utils import (
    make_char_tokenizer,
    make_tiny_qwen2,
)
from retool_trl.rollout.engines.transformers_generate import TransformersBackend

TOKENIZER = make_char_tokenizer()


def backend(model, reuse=True, **config):
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=30,
        eos_token_id=[TOKENIZER.eos_token_id],
        pad_token_id=TOKENIZER.pad_token_id,
        **config,
    )
    return TransformersBackend(model, TOKENIZER, config, "</code>", [TOKENIZER.eos_token_id], reuse_cache=reuse)


def test_cache_is_really_reused_on_the_next_turn():
    model = make_tiny_qwen2(TOKENIZER).eval()
    b = backend(model)
    first = b.generate_turn([[5, 6, 7], [8, 9]], [4, 4], [False, False])
    kept = b._cache
    assert kept is not None
    seqs = [[5, 6, 7, *first[0].token_ids, 10, 11], [8, 9, *first[1].token_ids]]
    ids, mask, cache = b._batch(seqs, "cpu")
    assert cache is kept  # continued from the kept cache, not a fresh prefill
    # The row without new tokens is fed its last token again (its earlier copy hidden), so the next token is
    # sampled from that token's state, never from a masked hole.
    assert mask[1, -2:].tolist() == [0, 1] and ids[1, -1].item() == seqs[1][-1]
    assert mask.sum(dim=1).tolist() == [len(s) for s in seqs]


@pytest.mark.parametrize("config", [{"cache_implementation": "static"}, {"repetition_penalty": 1.3}])
def test_cache_reuse_falls_back_where_holes_are_not_exact(config):
    model = make_tiny_qwen2(TOKENIZER).eval()
    b = backend(model, **config)
    outs = b.generate_turn([[5, 6, 7], [8, 9]], [4, 4], [False, False])
    assert b._cache is None  # no reuse: the next turn prefills afresh
    b.generate_turn([[5, 6, 7, *outs[0].token_ids, 10]], [3], [False])  # and does not crash
