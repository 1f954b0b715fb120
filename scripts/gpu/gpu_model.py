"""The model of `scripts/gpu/gpu_check.py`: Qwen2.5's shape, vocabulary size and chat template, random weights, built
locally (the GPU machine has no model hub)."""

from __future__ import annotations

import torch


def build_tokenizer(bpe_tokens: int):
    """A byte-level BPE with `bpe_tokens` entries (the 256 byte symbols, then pairs and triples of them, printable
    ASCII first, each with its merge), Qwen2.5's special tokens at Qwen2.5's ids (`<|endoftext|>`, `<|im_start|>`,
    `<|im_end|>`), the ReTool tags, reserved specials up to Qwen2.5's 22 added tokens, and Qwen2.5's chat template
    as TRL bundles it. Same vocabulary size and prompt format as the real one; the merges are synthetic."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen2_5_chat_template

    from retool_trl.format.prompts import Tags

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: (not (" " <= c <= "~"), ord(c)))
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    merges, pairs = [], []
    for a in alphabet:
        for b in alphabet:
            if len(vocab) < bpe_tokens:
                vocab[a + b] = len(vocab)
                merges.append((a, b))
                pairs.append(a + b)
    for ab in pairs:
        for c in alphabet:
            if len(vocab) < bpe_tokens:
                vocab[ab + c] = len(vocab)
                merges.append((ab, c))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tags = list(vars(Tags()).values())
    reserved = [f"<|reserved_{i}|>" for i in range(22 - len(specials) - len(tags))]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in reserved])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=qwen2_5_chat_template,
        clean_up_tokenization_spaces=False,
        model_max_length=32_768,
    )


def build_model(tokenizer, shape: dict, device: str, dtype: torch.dtype):
    """A randomly initialised (seeded) Qwen2 of `shape`, built directly on `device` in `dtype`, SDPA attention."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    config = Qwen2Config(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        max_position_embeddings=shape["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos[0],  # as Qwen2.5-Instruct: <|im_end|> in the config, both in the generation config
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model
