"""The rollout: how a batch of prompts becomes completions that call the interpreter, with their interpreter mask.

Two loops over the same turn logic (`turns`): `batched` moves every completion of a batch one turn at a time and runs
the batch's cells together (`rollout_mode: barrier`, and the transformers engine); `per_completion` gives each
completion its own generate -> execute -> continue loop (`rollout_mode: async`). Both keep a completion's state in the
same `rows`, run its calls through the same `cells` and read the same `spec`. The engines they drive live in
`engines/`, one module each. A rollout imports the sandbox, never the trainer.
"""

from .batched import interleaved_rollout
from .spec import ROLLOUT_FIELDS, RolloutResult, RolloutSpec
from .types import GenerationBackend, TurnOutput

__all__ = ["ROLLOUT_FIELDS", "GenerationBackend", "RolloutResult", "RolloutSpec", "TurnOutput", "interleaved_rollout"]
