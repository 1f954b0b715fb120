"""Tiny models for CPU runs, tests and benchmarks, built locally (no hub): a character-level tokenizer, a small
randomly initialised Qwen2, and a logits processor that makes a real model write a scripted text.

    from retool_trl.models.tiny import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer)  # ~0.7M parameters; `save_tiny_model(path, tokenizer)` writes a folder

The quickstart checkpoint is built from these (`scripts/build/build_quickstart_model.py`). This module imports torch
and transformers; `import retool_trl` does not import it.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from ..format.prompts import Tags

PAD_TOKEN, EOS_TOKEN = "<|pad|>", "<|endoftext|>"


def build_char_tokenizer(tags: tuple[str, str, str, str] = tuple(vars(Tags()).values()), model_max_length: int = 512):
    """A character-level tokenizer: one token per byte (a byte-level BPE with no merges), the four format tags as
    single (non-special) tokens, and `<|pad|>` / `<|endoftext|>` (EOS).

    Byte-level rather than a table of chosen characters, for two reasons: any text (interpreter tracebacks,
    non-ASCII output) stays representable and decodes exactly; and `AutoTokenizer` loads every `qwen2` checkpoint
    as `Qwen2Tokenizer`, which rebuilds a byte-level BPE pipeline around the saved vocabulary, so this tokenizer
    behaves the same whichever class loads it. Non-special tags survive `decode(..., skip_special_tokens=True)`,
    which TRL applies to completions.

    Args:
        tags (tuple of 4 `str`): `code_start`, `code_end`, `interpreter_start`, `interpreter_end`.
        model_max_length (`int`): Longest sequence the model handles.

    Returns:
        `PreTrainedTokenizerFast` with `pad_token` and `eos_token` set.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD_TOKEN, EOS_TOKEN]
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)  # the 256 printable stand-ins for bytes
    vocab = {token: i for i, token in enumerate(specials + byte_symbols)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    # The same normalizer, pre-tokenizer and decoder as Qwen2Tokenizer (its regex pre-split changes nothing
    # without merges).
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,  # decoding must give back the exact text
        model_max_length=model_max_length,
    )


CHAT_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def build_chat_tokenizer(
    texts, vocab_size: int = 1024, chat_template: str | None = None, model_max_length: int = 1024
):
    """A small Qwen2.5-style chat tokenizer: a byte-level BPE of `vocab_size` tokens trained on `texts` with Qwen2's
    pre-tokenizer (digits stay single tokens, so copying numbers stays easy), Qwen's special tokens
    (`<|endoftext|>` pad, `<|im_start|>`, `<|im_end|>` EOS) and its tool tags as added tokens, and TRL's Qwen2.5 chat
    template (`trl/chat_templates/qwen2_5.jinja`) by default.

    Trained on the rendered conversations of a task, the template's constant text (the tool schema in the system
    turn, the call's JSON keys) compresses into whole-word tokens: a prompt is a few hundred tokens, not the ~900
    characters it renders to.

    Args:
        texts (iterable of `str`): Rendered conversations to train the merges on.
        vocab_size (`int`): Vocabulary size (bytes, merges and the added tokens).
        chat_template (`str`, *optional*): Jinja chat template (default: TRL's `qwen2_5`).
        model_max_length (`int`): Longest sequence the model handles.

    Returns:
        `PreTrainedTokenizerFast` with `pad_token`, `eos_token` and `chat_template` set.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Qwen2's own pre-tokenizer (single digits, words with their leading space): `AutoTokenizer` loads a `qwen2`
    # checkpoint as `Qwen2Tokenizer`, which rebuilds it around the saved vocabulary, so the merges are learnt with it.
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    if chat_template is None:
        from trl.chat_template_utils import qwen2_5_chat_template as chat_template
    backend = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t in CHAT_SPECIAL_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(CHAT_ADDED_TOKENS),
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The special and added tokens are cut out of the texts: the merges are learnt on what lies between them.
    pieces = list(texts)
    for token in (*CHAT_SPECIAL_TOKENS, *CHAT_ADDED_TOKENS):
        pieces = [part for text in pieces for part in text.split(token)]
    backend.train_from_iterator(pieces, trainer=trainer)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in CHAT_ADDED_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=CHAT_SPECIAL_TOKENS[0],
        eos_token=CHAT_SPECIAL_TOKENS[2],
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def build_tiny_model(
    tokenizer,
    hidden_size: int = 128,
    num_layers: int = 3,
    num_heads: int = 4,
    intermediate_size: int = 384,
    max_position_embeddings: int = 512,
    seed: int = 0,
    num_key_value_heads: int | None = None,
):
    """A randomly initialised (seeded) Qwen2 causal LM sized for CPU training; embeddings are tied.

    Args:
        tokenizer: Its tokenizer (vocabulary size and pad/EOS ids).
        hidden_size, num_layers, num_heads, intermediate_size, max_position_embeddings (`int`): Architecture.
        seed (`int`): Initialisation seed.
        num_key_value_heads (`int`, *optional*): Grouped-query attention heads (default: `num_heads`).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_key_value_heads or num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tiny_model(path, tokenizer, **kwargs) -> str:
    """Saves a [`build_tiny_model`] model (`kwargs` go to it) and `tokenizer` to the folder `path`; returns it."""
    model = build_tiny_model(tokenizer, **kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


class ScriptForcingProcessor(LogitsProcessor):
    """Makes a real model emit scripted turns through `generate` (every forward pass still runs).

    `turns[key]` lists the token ids of each turn of the sequence whose non-padding ids start with `key` (its
    prompt; all keys have the same length). The turn index is the number of code-end tags already in the sequence,
    so the same turns serve every turn of an interleaved rollout; after a turn's last token it forces EOS; a `None`
    turn is left to the model (for all rows of that call: script every row's turns alike). Use a new
    processor for each `generate` call (it remembers where the call started).
    """

    def __init__(self, turns: dict, tokenizer, code_end: str = "</code>"):
        self.turns, self.tokenizer, self.code_end = turns, tokenizer, code_end
        self.key_len = len(next(iter(turns)))
        self.start_width, self.plan = None, None

    def __call__(self, input_ids, scores):
        if self.start_width is None:
            # First step of a new `generate` call: find each row's script and turn.
            self.start_width, self.plan = input_ids.shape[1], []
            pad = self.tokenizer.pad_token_id
            for row in input_ids.tolist():
                start = next((i for i, t in enumerate(row) if t != pad), len(row))
                key = tuple(row[start : start + self.key_len])
                turn = self.tokenizer.decode(row[start + self.key_len :]).count(self.code_end)
                self.plan.append(self.turns[key][turn])
        step = input_ids.shape[1] - self.start_width
        if all(turn is None for turn in self.plan):  # an unscripted turn: the model decides
            return scores
        eos = self.tokenizer.eos_token_id
        forced = torch.tensor([turn[step] if step < len(turn) else eos for turn in self.plan], device=scores.device)
        # Replace the scores outright: any later warper (top-k, top-p) then still keeps exactly the forced token.
        forced_scores = torch.full_like(scores, float("-inf"))
        forced_scores[torch.arange(len(forced), device=scores.device), forced] = 0.0
        return forced_scores


def script_turns(tokenizer, script: str, code_end: str = "</code>") -> list[list[int]]:
    """The script's token ids (tokenized as a whole) split into turns after each token that completes a code-end
    tag, as a model writing this text would be stopped; the last turn runs to the end."""
    ids = tokenizer(script, add_special_tokens=False)["input_ids"]
    turns, start, seen = [], 0, 0
    for i in range(1, len(ids) + 1):
        count = tokenizer.decode(ids[:i]).count(code_end)
        if count > seen:
            turns.append(ids[start:i])
            start, seen = i, count
    return [*turns, ids[start:]]


__all__ = [
    "EOS_TOKEN",
    "PAD_TOKEN",
    "ScriptForcingProcessor",
    "build_char_tokenizer",
    "build_chat_tokenizer",
    "build_tiny_model",
    "save_tiny_model",
    "script_turns",
]
