"""The `tool_call` format: the chat template's own tool calls to a `code_interpreter` tool.

The model writes a tool call as its chat template taught it (Qwen: `<tool_call>{"name": "code_interpreter",
"arguments": {"code": ...}}</tool_call>`, Llama 3.1: a JSON object) and ends its assistant turn; the results come
back as `tool` messages rendered by the same template, and a new assistant turn starts. The pieces are TRL's, as in
its own `tools=` loop: the response schema of a known template (`add_response_schema`) and `parse_response` read the
turn; the ids a tool message inserts are what TRL's trainer computes for its tool loop (`_get_tool_suffix_ids`, the
template's rendering after the assistant's end-of-turn token); a template must be prefix-preserving
(`is_chat_template_prefix_preserving`), or those ids would not be the ones the template renders.

Several calls in one turn run in order, in the completion's one session. A call that does not parse (broken JSON,
another tool's name, no `code` argument) is the model's error: it is counted as a call that failed, and the model is
shown why as that call's result.
"""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

from ..errors import UserError
from .calls import Call, CallFormat, SFTTrace
from .convert import trace_cells
from .parsing import clean_output, remove_first_spans
from .prompts import Tags
from .registry import register_format

TOOL_NAME = "code_interpreter"
# Llama 3.1: `code_interpreter` is its built-in tool, called as `<|python_tag|>` + code + `<|eom_id|>`.
PYTHON_TAG = "<|python_tag|>"
END_OF_MESSAGE = "<|eom_id|>"
CODE_TOOL = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": (
            "Runs Python code in a persistent session (variables and imports carry over between calls) and returns "
            "what it prints (stdout, stderr and any traceback)."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The Python code to run."}},
            "required": ["code"],
        },
    },
}
TOOLS = [CODE_TOOL]


class ToolProse:
    """What the model wrote outside its tool calls and the tool messages, without a tokenizer (for the rewards):
    Qwen-style markers, and JSON calls to the tool written bare (Llama 3.1)."""

    spans = (("<tool_call>", "</tool_call>"), ("<tool_response>", "</tool_response>"))

    def model_prose(self, text: str) -> str:
        text = remove_first_spans(text, self.spans)
        pieces, pos = [], 0
        while (start := text.find('{"name": "' + TOOL_NAME, pos)) >= 0:
            pieces.append(text[pos:start])
            pos = _json_end(text, start)
        return "".join(pieces) + text[pos:]


def _json_end(text: str, start: int) -> int:
    """The end of the JSON object that starts at `start` (balanced braces, strings skipped), or the text's end."""
    depth, i, in_string = 0, start, False
    while i < len(text):
        char = text[i]
        if in_string:
            i += 1 if char == "\\" else 0
            in_string = char != '"'
        elif char == '"':
            in_string = True
        elif char in "{}":
            depth += 1 if char == "{" else -1
            if depth == 0:
                return i + 1
        i += 1
    return len(text)


@register_format
class ToolCallFormat(ToolProse, CallFormat):
    """The chat template's tool calls (see the module docstring). Built once per tokenizer."""

    name = "tool_call"
    summary = "its chat template's tool calls"
    writes = (
        'its template\'s tool call, e.g. Qwen\'s `<tool_call>{"name": "code_interpreter", "arguments": '
        '{"code": "print(6*7)"}}</tool_call>`'
    )
    answered_by = "a `tool` message, rendered by the chat template"
    stops_at = "the end of the assistant turn (e.g. `<\\|im_end\\|>`)"
    prompts = {
        "retool": (
            "Solve the problem step by step. You can call the `code_interpreter` tool to run Python code in a "
            "persistent session (variables and imports carry over between calls); it returns what the code prints. "
            "Use it for exact computation and to check your reasoning; print the values you need. When you are done, "
            "write the final answer once as \\boxed{{answer}}."
        ),
        "retool_concise": (
            "Call the `code_interpreter` tool for any computation. End with the final answer in \\boxed{{}}."
        ),
    }
    tools = TOOLS  # the template writes the tool's schema and its instructions into the prompt
    needs_chat_template = True
    # A plain-text prompt would carry no tool schema: the template renders it into conversations only.
    eval_defaults = {"prompt_format": "conversational"}

    stop = None  # a turn ends at the template's end-of-turn token, calls and all
    calls_at_turn_end = True

    @classmethod
    def from_config(cls, args, tokenizer=None) -> ToolCallFormat:
        if tokenizer is None:
            raise ValueError("call_format='tool_call' needs the tokenizer")
        return cls(tokenizer, getattr(args, "chat_template_kwargs", None))

    @classmethod
    def stop_for(cls, args) -> None:
        return None

    @classmethod
    def prose_for(cls, args) -> ToolProse:
        return ToolProse()

    @classmethod
    def sft_trace(cls, completion: str, tags: Tags = Tags()) -> SFTTrace:
        return SFTTrace(messages=to_tool_messages(completion, tags))

    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None):
        from trl.chat_template_utils import add_response_schema, is_chat_template_prefix_preserving

        # A copy: the response schema set below is this format's; on the trainer's own tokenizer it would change how
        # TRL decodes completions (one assistant message, the last turn only) and be saved with the model.
        tokenizer = copy.copy(getattr(tokenizer, "tokenizer", tokenizer))
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(
                "call_format='tool_call' needs a tokenizer with a chat template that renders tool calls: use the "
                "model's instruct tokenizer, or call_format='tags' / 'markdown'."
            )
        if (
            getattr(tokenizer, "response_template", None) is None
            and getattr(tokenizer, "response_schema", None) is None
        ):
            try:
                _add_response_schema(tokenizer, add_response_schema)
            except ValueError:
                raise UserError(
                    "call_format='tool_call': TRL has no response schema for this tokenizer's chat template, so its "
                    "tool calls cannot be parsed; set `tokenizer.response_template` (transformers' response parsing), "
                    "use one of TRL's chat templates (trl/chat_templates), or call_format='tags' / 'markdown'."
                ) from None
        if not is_chat_template_prefix_preserving(tokenizer):
            raise UserError(
                "call_format='tool_call' needs a prefix-preserving chat template (earlier turns must render the same "
                "whatever follows), and this tokenizer's is not: set the tokenizer's chat template to TRL's training "
                "template (`trl.chat_template_utils.get_training_chat_template(tokenizer)`), or call_format='tags'."
            )
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        # Where an assistant turn's calls are read: its end-of-turn token, and Llama 3.1's end-of-message token,
        # which ends a turn that waits for a tool's answer (its built-in python tool and JSON calls).
        eom = tokenizer.convert_tokens_to_ids(END_OF_MESSAGE) if END_OF_MESSAGE in tokenizer.get_vocab() else None
        self.turn_end_ids = frozenset(i for i in (tokenizer.eos_token_id, eom) if i is not None)
        self.markers = _call_markers(tokenizer)
        self.guarded = tuple(sorted(set(tokenizer.get_added_vocab()) | set(self.markers)))
        self.kept_texts = ()  # the template's special tokens are not the model's prose

    def calls(self, turn_ids: list[int], prefix_ids: list[int]) -> list[Call]:
        """The calls of an assistant turn (`turn_ids`, its end-of-turn token included), read by TRL's
        `parse_response` after the context `prefix_ids`; an attempted call that does not parse is a `Call` with an
        error."""
        from trl.chat_template_utils import parse_response

        parsed = parse_response(self.tokenizer, list(turn_ids), prefix=list(prefix_ids), tools=TOOLS)
        calls = [_read_call(call) for call in parsed.get("tool_calls") or []]
        body = list(turn_ids[:-1]) if turn_ids and turn_ids[-1] in self.turn_end_ids else list(turn_ids)
        text = remove_first_spans(self.tokenizer.decode(body, skip_special_tokens=False), _THINKING)
        blocks = [block for marker in self.markers for block in _marked_blocks(text, marker)]
        if len(blocks) > len(calls):
            # TRL's parser reads a turn with one malformed call as plain text, valid calls beside it included: read
            # the calls block by block, so each valid one runs and each malformed one is the model's error. A marker
            # inside the thinking is not a call (it is text about one).
            return [_read_block(block) for block in blocks]
        if not calls and PYTHON_TAG in text:
            # Llama 3.1's built-in python tool (`code_interpreter`): raw code after the tag (or a JSON call).
            code = text.split(PYTHON_TAG, 1)[1]
            return [_read_block(code) if code.lstrip().startswith("{") else Call(code.strip("\n"))]
        if not self.markers and not calls and text.lstrip().startswith('{"name"'):
            return [_read_block(text)]  # a bare JSON call TRL did not read (e.g. one ended by `<|eom_id|>`)
        return calls

    def clean(self, output: str) -> str:
        return clean_output(output, self.guarded)

    def result_ids(self, tokenizer, outputs: list[list[str]]) -> list[list[int]]:
        """The ids of each row's tool messages (one per call, in order) as the template renders them after the
        assistant's end-of-turn token, up to the next assistant turn's header: TRL's own computation."""
        from trl import GRPOTrainer

        shim = SimpleNamespace(
            processing_class=self.tokenizer,
            _tokenizer=self.tokenizer,
            _is_vlm=False,
            chat_template=None,
            chat_template_kwargs=self.chat_template_kwargs,
        )
        return [
            list(
                GRPOTrainer._get_tool_suffix_ids(
                    shim, [{"role": "tool", "name": TOOL_NAME, "content": output} for output in row]
                )
            )
            for row in outputs
        ]


_UNPARSED = (
    f'Error: the tool call could not be read. Call the tool `{TOOL_NAME}` with a JSON object {{"code": "<python>"}} '
    "as its arguments."
)


# Reasoning spans (Qwen3, DeepSeek-R1 style templates): what is written there is text, never a call.
_THINKING = (("<think>", "</think>"),)


def _marked_blocks(text: str, marker: str) -> list[str]:
    """The text of each call opened by `marker` (Qwen: `<tool_call>`), up to its closing marker (`</tool_call>`),
    the next call or the end of the turn."""
    closing = f"</{marker[1:]}" if marker.startswith("<") else None
    pieces = text.split(marker)[1:]
    return [piece.split(closing, 1)[0] if closing else piece for piece in pieces]


def _read_block(block: str) -> Call:
    """One call's JSON (`{"name": ..., "arguments": ...}`), read on its own."""
    try:
        call = json.loads(block.strip())
    except ValueError:
        return Call(None, _UNPARSED)
    if not isinstance(call, dict):
        return Call(None, _UNPARSED)
    arguments = call.get("arguments", call.get("parameters"))  # Llama 3.1 writes `parameters`
    return _read_call({"function": {"name": call.get("name"), "arguments": arguments}})


def _read_call(call: dict) -> Call:
    function = call.get("function") or {}
    name = function.get("name")
    if name != TOOL_NAME:
        return Call(None, f"Error: there is no tool {name!r}; the only tool is `{TOOL_NAME}`.")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return Call(None, _UNPARSED)
    code = arguments.get("code") if isinstance(arguments, dict) else None
    if not isinstance(code, str):
        return Call(None, _UNPARSED)
    return Call(code)


def _add_response_schema(tokenizer, add_response_schema) -> None:
    """TRL's response schema for the tokenizer's template; for one of TRL's training templates (the
    prefix-preserving variants it ships), the schema of the template it was derived from, as TRL's trainer sets the
    schema before it swaps in the training template."""
    import trl.chat_template_utils as templates

    for name in dir(templates):
        if name.endswith("_training_chat_template") and getattr(templates, name) == tokenizer.chat_template:
            base = getattr(templates, name.replace("_training_chat_template", "_chat_template"), None)
            if base is not None:
                training, tokenizer.chat_template = tokenizer.chat_template, base
                try:
                    add_response_schema(tokenizer)
                finally:
                    tokenizer.chat_template = training
                return
    add_response_schema(tokenizer)


def _call_markers(tokenizer) -> tuple[str, ...]:
    """The text the template writes before a tool call's JSON (Qwen: `<tool_call>`), found by rendering one; empty
    where the JSON stands alone (Llama 3.1)."""
    sentinel = "sentinel_tool_a8f3"
    call = {"type": "function", "function": {"name": sentinel, "arguments": {}}}
    base = [{"role": "user", "content": "x"}]
    try:
        before = tokenizer.apply_chat_template(base, tokenize=False, add_generation_prompt=True)
        after = tokenizer.apply_chat_template(
            [*base, {"role": "assistant", "content": "", "tool_calls": [call]}], tokenize=False
        )
    except Exception:  # noqa: BLE001 - a template that cannot render a call has no markers to find
        return ()
    rendered = after[len(before) :] if after.startswith(before) else after
    head = rendered[: rendered.find(sentinel)]
    head = head[: head.rfind("{")] if "{" in head else head
    return tuple(head.split()[-1:])  # the last piece: a thinking block may come before it (Qwen3)


def to_tool_messages(completion: str, tags: Tags = Tags(), tool_name: str = TOOL_NAME) -> list[dict]:
    """The trace as chat messages: an assistant message per code call (its prose as content, the code as a tool
    call), a `tool` message with the interpreter's output after each, and the closing assistant message."""
    messages = []
    for prose, code, output in trace_cells(completion, tags):
        if code is None:
            messages.append({"role": "assistant", "content": prose.strip()})
            break
        call = {"type": "function", "function": {"name": tool_name, "arguments": {"code": code}}}
        messages.append({"role": "assistant", "content": prose.strip(), "tool_calls": [call]})
        messages.append({"role": "tool", "name": tool_name, "content": output or ""})
    return messages


__all__ = ["CODE_TOOL", "TOOLS", "TOOL_NAME", "ToolCallFormat", "ToolProse", "to_tool_messages"]
