"""How the model calls the interpreter, and the text around it.

- `calls`: what a call format is (`CallFormat`, `StopFormat`, `Call`), the one class each format writes;
- `registry`: the registered formats (`register_format`, `get_format`), where the config's and the command line's
  choices, help and validation come from;
- the built-in formats, one module each: `tags` (the ReTool paper's, the default), `tool_calls` (the chat template's
  own tool calls) and `markdown` (```` ```python ```` blocks);
- `prompts` (the tags, the shipped prompts' names, prompt settings saved with a model) and `parsing` (code, model
  prose and `\\boxed{}` answers in text). Strings only at import: no torch, no TRL.
"""

# The built-in formats register themselves on import, in this order (the first is the default).
from . import tags as _tags  # noqa: F401, I001 - registration order
from . import tool_calls as _tool_calls  # noqa: F401
from . import markdown as _markdown  # noqa: F401
from .calls import Call, CallFormat, SFTTrace, StopFormat
from .markdown import MarkdownFormat
from .prompts import SHIPPED_PROMPTS, Tags
from .registry import FORMAT_NAMES, format_of, get_format, register_format, resolve_system_prompt, unregister_format
from .tags import TagFormat
from .tool_calls import ToolCallFormat

# The `tags` format's shipped prompts by name (with `{code_start}`-style placeholders), as earlier versions named them.
SYSTEM_PROMPTS = TagFormat.prompts

__all__ = [
    "FORMAT_NAMES",
    "SHIPPED_PROMPTS",
    "SYSTEM_PROMPTS",
    "Call",
    "CallFormat",
    "MarkdownFormat",
    "SFTTrace",
    "StopFormat",
    "TagFormat",
    "Tags",
    "ToolCallFormat",
    "format_of",
    "get_format",
    "register_format",
    "resolve_system_prompt",
    "unregister_format",
]
