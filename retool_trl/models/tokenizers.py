"""Tokenizers for the interleaved format: loaded as TRL's GRPOTrainer loads them, and checked before a model is.

The rollout cuts code out of decoded text and runs it, and stops generation on decoded tags: a tokenizer that loses
characters, cannot spell a tag, or drops a tag as a special token breaks training silently. `check_tokenizer` finds
those cases up front and names the fix.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from ..errors import UserError, one_line


def check_tokenizer(
    tokenizer,
    source: str,
    tags: Mapping[str, str] | None = None,
    pad_token: str | None = None,
    needs_chat_template: bool | str = False,
) -> None:
    """Checks (and where asked, fixes) a tokenizer before any model is loaded.

    Args:
        tokenizer: The tokenizer.
        source (`str`): Where it comes from, for messages.
        tags (`dict`, *optional*): `{config field: tag}`; each must encode and decode back to itself without unknown
            tokens, and survive `skip_special_tokens=True` (TRL decodes completions that way).
        pad_token (`str`, *optional*): Set as pad token if the tokenizer has none.
        needs_chat_template (`bool` or `str`): A chat template is needed: by conversational prompts (`True`), or
            by what the string names (a call format that renders its calls with the template).

    Raises:
        UserError: naming the tokenizer, the offending tag or token, and the fix.
    """
    if tokenizer.pad_token is None:
        if pad_token is None:
            eos = tokenizer.eos_token
            fix = f"set `pad_token: {eos!r}` (its EOS token)" if eos else "set `pad_token` to one of its tokens"
            raise UserError(f"the tokenizer of {source} has no pad token: {fix} in the config, or pass --pad_token.")
        token_id = tokenizer.convert_tokens_to_ids(pad_token)
        if token_id is None or (
            tokenizer.unk_token_id is not None
            and token_id == tokenizer.unk_token_id
            and pad_token != tokenizer.unk_token
        ):
            raise UserError(
                f"pad_token {pad_token!r} is not a token of the tokenizer of {source}; use an existing "
                f"token such as {tokenizer.eos_token!r}."
            )
        tokenizer.pad_token = pad_token
    if needs_chat_template and not getattr(tokenizer, "chat_template", None):
        if isinstance(needs_chat_template, str):  # plain prompts would not help: the calls themselves need it
            raise UserError(
                f"the tokenizer of {source} has no chat template, which {needs_chat_template} needs: give one with "
                "`--chat_template_path` (a .jinja file such as TRL's trl/chat_templates/qwen2_5.jinja, or a model "
                "whose tokenizer has one)."
            )
        raise UserError(
            f"the tokenizer of {source} has no chat template, which conversational prompts need: give one with "
            "`--chat_template_path` (a .jinja file or a model whose tokenizer has one), or set `prompt_format: plain`."
        )
    unk = tokenizer.unk_token_id
    # Code is cut out of decoded text and run: a tokenizer that loses characters (e.g. whitespace) breaks it.
    probe = "Let me check.\nimport math\nx = 6 * 7\nprint(x)"
    back = tokenizer.decode(
        tokenizer(probe, add_special_tokens=False)["input_ids"],
        skip_special_tokens=True,
        clean_up_tokenization_spaces=False,
    )
    if back != probe:
        raise UserError(
            f"the tokenizer of {source} does not give back the text it encodes ({probe!r} decodes as {back!r}), so "
            "code written by the model cannot be run: use a tokenizer that round-trips text (check its "
            "tokenizer_class in tokenizer_config.json)."
        )
    for name, tag in (tags or {}).items():
        ids = tokenizer(tag, add_special_tokens=False)["input_ids"]
        text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if (unk is not None and unk in ids) or text != tag:
            how = "contains unknown tokens" if unk is not None and unk in ids else f"decodes back as {text!r}"
            raise UserError(
                f"{name} {tag!r} cannot be represented by the tokenizer of {source} (it {how}): choose a tag made of "
                f"text the tokenizer knows, or add it with `tokenizer.add_tokens([{tag!r}])` and resize the model's "
                "embeddings."
            )
        if tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) != tag:
            raise UserError(
                f"{name} {tag!r} is a special token of the tokenizer of {source}, so it is dropped when completions "
                "are decoded: add it as a regular token (`tokenizer.add_tokens([...], special_tokens=False)`) or "
                "choose another tag."
            )


_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def declares_generic_tokenizer(path: str) -> bool:
    """Whether the folder `path` saved a generic tokenizer (`TokenizersBackend`), which must be loaded as saved."""
    config_file = Path(path, "tokenizer_config.json")
    if not config_file.is_file():
        return False
    import json

    try:
        return json.loads(config_file.read_text()).get("tokenizer_class") in _GENERIC_TOKENIZER_CLASSES
    except (OSError, ValueError, AttributeError):
        return False


def load_tokenizer(
    path: str, revision: str | None = None, trust_remote_code: bool = False, chat_template_path: str | None = None
):
    """The tokenizer of a model folder or hub id, left-padded and left-truncated as TRL's GRPOTrainer loads it.

    `chat_template_path` replaces its chat template with a Jinja file's (`.jinja`/`.j2`, as TRL's SFT reads it) or
    with the template of another tokenizer (a folder or hub id). The trainer saves the tokenizer it trained with, so a
    trained folder carries the template on to evaluation.

    A folder whose `tokenizer_config.json` declares a generic tokenizer (`TokenizersBackend`) is loaded as saved:
    transformers 5's `AutoTokenizer` would otherwise substitute the model type's class (e.g. `Qwen2Tokenizer` for a
    Qwen2 config), whose own pre-tokenizer can change how text is split, e.g. drop the whitespace of a character-level
    tokenizer such as the quickstart model's.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    kwargs = dict(revision=revision, trust_remote_code=trust_remote_code, padding_side="left", truncation_side="left")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        if type(tokenizer).__name__ not in _GENERIC_TOKENIZER_CLASSES and declares_generic_tokenizer(path):
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as error:
        raise UserError(
            f"cannot load the tokenizer of {path!r}: {one_line(error).split('. ')[0]}; check "
            "model_name_or_path (a local folder or a hub id)."
        ) from None
    if chat_template_path:
        tokenizer.chat_template = _chat_template_from(chat_template_path, trust_remote_code)
    return tokenizer


def _chat_template_from(source: str, trust_remote_code: bool) -> str:
    """The chat template in a Jinja file, or that of the tokenizer of a folder or hub id."""
    if os.path.isfile(source):
        return Path(source).read_text(encoding="utf-8")
    from transformers import AutoTokenizer

    try:
        template = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code).chat_template
    except (OSError, ValueError) as error:
        template, why = None, one_line(error).split(". ")[0]
    else:
        why = "its tokenizer has no chat template"
    if not template:
        raise UserError(
            f"chat_template_path {source!r} gives no chat template ({why}): give a .jinja file or a tokenizer "
            "folder that has one."
        )
    return template


__all__ = ["check_tokenizer", "declares_generic_tokenizer", "load_tokenizer"]
