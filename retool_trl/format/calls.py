"""What a call format is: the one class a format writes, and what the rest of the package asks of it.

A call format (`ReToolConfig.call_format`) says how the model calls the interpreter and how the result comes back.
Everything about a format lives on its class, and nothing outside `retool_trl.format` reads a format's name:

- the user surface: its `name`, a one-line `summary` (the config's and the command line's help), the cells of the
  docs' formats table (`writes`, `answered_by`, `stops_at`), its shipped system prompts (`prompts`, one per shipped
  prompt name), the tools its prompt carries (`tools`), whether it needs a chat template, and the evaluation
  options it sets where the user did not (`eval_defaults`);
- the rollout, which asks three things and nothing else about the text: where a call ends (`stop`, or the end of an
  assistant turn for `calls_at_turn_end`), what code a finished turn carries (`calls`), and which ids the results
  insert (`result_ids`);
- the rewards: what the model wrote outside its calls and their results (`model_prose`);
- cold-start SFT: a ReTool-style trace rewritten in the format (`sft_trace`).

A new format is one class, registered with `retool_trl.format.register_format`. Strings only here: no torch, no TRL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .parsing import clean_output, remove_first_spans
from .prompts import SHIPPED_PROMPTS, Tags


@dataclass(frozen=True)
class Call:
    """One call the model made in a turn: the code to run, or (`code is None`) the reason it could not be read,
    which the model is shown as the call's result (its error, counted as one)."""

    code: str | None
    error: str | None = None
    counted: bool = True  # False for a call past the limit: answered without running, not counted


@dataclass(frozen=True)
class SFTTrace:
    """A ReTool-style trace rewritten in a call format, for cold-start SFT (`retool_trl.sft` tokenizes it).

    Either `text`, the completion as the model writes it in the format, with `spans` the markers of its calls
    (`code_start`/`code_end`) and of the inserted results (`interpreter_start`/`interpreter_end`, masked from the
    loss); or `messages`, chat messages (assistant turns with `tool_calls`, `tool` results) the chat template renders.
    """

    text: str | None = None
    spans: Tags | None = None
    messages: list[dict] | None = None


class CallFormat:
    """The base of every call format (see the module docstring). Subclasses set the class attributes and implement
    `calls`, `result_ids` and `sft_trace`; `StopFormat` does most of it for a format whose call ends at a string."""

    # --- the user surface (read by the registry, the config, the command line and the docs' table)
    name: ClassVar[str]
    summary: ClassVar[str]  # one line: what the model writes and what comes back
    writes: ClassVar[str]  # the docs' formats table: an example of a call ...
    answered_by: ClassVar[str]  # ... what the result comes back as ...
    stops_at: ClassVar[str]  # ... and where a turn stops
    # The shipped system prompts, one for each name in `prompts.SHIPPED_PROMPTS`, worded for this format. They may
    # name the configured tags as `{code_start}`, `{code_end}`, `{interpreter_start}`, `{interpreter_end}`.
    prompts: ClassVar[dict[str, str]]
    tools: ClassVar[list[dict] | None] = None  # tool schemas the prompt carries (the chat template renders them)
    needs_chat_template: ClassVar[bool] = False
    # Options of `retool-trl eval` this format sets where the user did not (e.g. conversational prompts).
    eval_defaults: ClassVar[dict] = {}

    # --- the rollout
    stop: str | None = None
    calls_at_turn_end = False  # calls read when an assistant turn ends (at one of `turn_end_ids`), not at `stop`
    turn_end_ids: frozenset[int] = frozenset()  # the tokens that end such a turn
    kept_texts: tuple[str, ...] = ()  # strings kept in the model's text even where a tokenizer makes them special
    spans: tuple[tuple[str, str], ...] = ()  # (start, end) of what is not the model's prose: calls and results
    guarded: tuple[str, ...] = ()  # strings printed output must not contain (they could close a result or open a call)

    @classmethod
    def from_config(cls, args, tokenizer=None) -> CallFormat:
        """The format of a config (`ReToolConfig`, or any object with the four tags): what the rollout asks."""
        return cls()

    @classmethod
    def stop_for(cls, args) -> str | None:
        """The string the engines stop a turn at (`None`: the turn's own end), without a tokenizer."""
        return cls.from_config(args).stop

    @classmethod
    def prose_for(cls, args):
        """What the rewards need, without a tokenizer: an object with `model_prose(text)`."""
        return cls.from_config(args)

    @classmethod
    def written_tags(cls, args) -> dict[str, str]:
        """The configured tags the model itself writes (checked against its tokenizer); none for most formats."""
        return {}

    @classmethod
    def system_prompt(cls, name: str, tags: Tags = Tags()) -> str | None:
        """The shipped prompt `name` worded for this format (the configured tags filled in), `None` if not shipped."""
        template = cls.prompts.get(name)
        if template is None:
            return None
        return template.format(**vars(tags))

    def calls(self, *turn):
        """The calls a finished turn carries (list of `Call`): `calls(call_text)` for a format that stops at `stop`
        (the text up to and with it), `calls(turn_ids, prefix_ids)` for one read at the end of a turn (the turn's
        token ids with its end token, and the ids before it)."""
        raise NotImplementedError

    def result_ids(self, tokenizer, outputs: list[list[str]]) -> list[list[int]]:
        """The ids each row's results insert (one list of cleaned, truncated outputs per row: one per call)."""
        raise NotImplementedError

    def clean(self, output: str) -> str:
        """Printed output made safe to insert (valid text, every guarded string defanged)."""
        return clean_output(output, self.guarded)

    def model_prose(self, text: str) -> str:
        """The text the model wrote outside its calls and their results (where a final answer counts)."""
        return remove_first_spans(text, self.spans)

    @classmethod
    def sft_trace(cls, completion: str, tags: Tags = Tags()) -> SFTTrace:
        """A ReTool-style trace (`completion`, marked with `tags`) as the model writes it in this format."""
        raise NotImplementedError


class StopFormat(CallFormat):
    """A format whose call ends at a stop string written by the model (`tags`, `markdown`).

    The engines stop a turn at the token completing `stop`; that token may carry characters after the stop (with a
    byte-level BPE, `</code>` is often completed by `><` or `>\\n\\n`). Those characters belong to the text that
    follows: the rollout keeps them (`carry`) and reads them as the start of the next turn.
    """

    def split(self, text: str) -> tuple[str, str] | None:
        """`(call text, carried text)` when `text` reached the stop: the call text ends with the stop, the rest is
        what the stop's last token carried. `None` when the turn did not reach the stop."""
        cut = text.find(self.stop) if self.stop else -1
        if cut < 0:
            return None
        end = cut + len(self.stop)
        return text[:end], text[end:]

    def calls(self, call_text: str) -> list[Call]:
        """The call that `call_text` (ending with the stop) closes: none when the stop closed no code block."""
        raise NotImplementedError

    def result_texts(self, outputs: list[str]) -> tuple[str, str]:
        """The frame around a result: `(before, after)`."""
        raise NotImplementedError

    def result_ids(self, tokenizer, outputs: list[list[str]]) -> list[list[int]]:
        """The output is encoded on its own with `split_special_tokens`, so text such as `<|endoftext|>` printed by
        code stays text and never becomes a control token; the frame around it is encoded as the tokenizer defines
        it."""
        if not outputs:  # never call the tokenizer on an empty batch
            return []
        start, end = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in self.result_texts([]))
        bodies = ["".join(row) for row in outputs]
        encoded = tokenizer(bodies, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return [[*start, *body, *end] for body in encoded]


__all__ = ["SHIPPED_PROMPTS", "Call", "CallFormat", "SFTTrace", "StopFormat"]
