"""The `tags` format (the default): the ReTool paper's inline tags, `<code>...</code>` answered by
`<interpreter>...</interpreter>` (the four tags are config fields)."""

from __future__ import annotations

from .calls import Call, SFTTrace, StopFormat
from .parsing import extract_code
from .prompts import Tags
from .registry import register_format


@register_format
class TagFormat(StopFormat):
    """`code_start` code `code_end`, answered by `interpreter_start` output `interpreter_end`."""

    name = "tags"
    summary = "the tags below, the ReTool paper's"
    writes = "`<code>print(6*7)</code>`"
    answered_by = "`<interpreter>42</interpreter>`"
    stops_at = "the code-end tag"
    # Written for this project; the format is the ReTool paper's. `{code_start}` etc. are the configured tags.
    prompts = {
        "retool": (
            "Solve the problem step by step. You have a Python interpreter: to run code, write it between "
            "{code_start} and {code_end}. Generation stops after {code_end}, the code runs in a persistent session "
            "(variables and imports carry over between calls), and what it prints is returned between "
            "{interpreter_start} and {interpreter_end}. Use the interpreter for exact computation and to check your "
            "reasoning; print the values you need. When you are done, write the final answer once as "
            "\\boxed{{answer}}."
        ),
        "retool_concise": (
            "Use Python between {code_start} and {code_end} for any computation; its output appears between "
            "{interpreter_start} and {interpreter_end}. End with the final answer in \\boxed{{}}."
        ),
    }

    def __init__(self, tags: Tags = Tags()):
        self.tags = tags
        self.stop = tags.code_end
        self.kept_texts = (tags.code_start, tags.code_end, tags.interpreter_start, tags.interpreter_end)
        self.spans = ((tags.code_start, tags.code_end), (tags.interpreter_start, tags.interpreter_end))
        self.guarded = self.kept_texts

    @classmethod
    def from_config(cls, args, tokenizer=None) -> TagFormat:
        return cls(Tags.from_config(args))

    @classmethod
    def written_tags(cls, args) -> dict[str, str]:
        return vars(Tags.from_config(args))

    def calls(self, call_text: str) -> list[Call]:
        code = extract_code(call_text, self.tags)
        return [] if code is None else [Call(code)]

    def result_texts(self, outputs):
        return self.tags.interpreter_start, self.tags.interpreter_end

    @classmethod
    def sft_trace(cls, completion: str, tags: Tags = Tags()) -> SFTTrace:
        return SFTTrace(text=completion, spans=tags)  # the traces as they are


__all__ = ["TagFormat"]
