"""The text format the model writes and reads: the tags and system prompts (`prompts`), and the string helpers that
find code, interpreter blocks, the model's own prose and its `\\boxed{}` answer (`parsing`). Strings only: no torch."""

from .prompts import SYSTEM_PROMPTS, Tags

__all__ = ["SYSTEM_PROMPTS", "Tags"]
