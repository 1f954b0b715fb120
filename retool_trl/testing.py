"""Test doubles for users' own tests of reward functions and rollouts, without a model or a real sandbox.

- [`FakeSandbox`]: the `retool_trl.sandbox` interface in-process (code really runs, with no isolation at all: use
  it only on code you trust), with forced outputs per snippet;
- [`ScriptedBackend`]: a generation backend that "writes" fixed texts token by token, as a model would.

    from retool_trl.rollout import RolloutSpec, interleaved_rollout
    from retool_trl.testing import FakeSandbox, ScriptedBackend

    backend = ScriptedBackend(tokenizer, ["<code>print(6*7)</code>So \\boxed{42}."])
    result = interleaved_rollout([prompt_ids], backend, FakeSandbox(), tokenizer, RolloutSpec(64, [eos_id]))

Neither imports torch. Tiny models to run for real are in `retool_trl.models.tiny`.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Sequence

from .rollout.types import TurnOutput
from .sandbox.base import ExecResult


class ScriptedBackend:
    """A generation backend that "writes" fixed texts, one per sequence, as a real model would emit tokens.

    Each script is tokenized once as a whole (never per turn), then emitted token by token: a turn stops after the
    token that completes the code-end tag (if requested), at the budget, or with EOS after the script's last token;
    with `code_end=None` (`call_format='tool_call'`), also after an EOS token written in the script (an assistant
    turn that ends with its tool calls).
    `scripts[i]` belongs to the i-th sequence of the first call; later calls (a subset of the sequences, extended by
    interpreter tokens) are matched to their script by the sequence each one had at the end of its previous turn.
    """

    def __init__(
        self,
        tokenizer,
        scripts: Sequence[str],
        code_end: str | None = "</code>",
        step_seconds: float = 0.0,
        eos_token_ids: Sequence[int] | None = None,
    ):
        self.tokenizer = tokenizer
        self.code_end = code_end
        # The ids a turn stops at, as the engines stop at every EOS id of the model's generation config (Llama 3.1:
        # `<|eot_id|>` and `<|eom_id|>`); the tokenizer's EOS by default.
        self.eos_token_ids = set(eos_token_ids or [tokenizer.eos_token_id])
        self.step_seconds = step_seconds
        self.script_ids = [tokenizer(s, add_special_tokens=False)["input_ids"] for s in scripts]
        self.cursor = [0] * len(scripts)
        self.last_sequence: list[list[int] | None] = [None] * len(scripts)
        self.turn_start: list[int | None] = [None] * len(scripts)  # where the last turn's output began
        self.last_emitted: list[list[int]] = [[] for _ in scripts]
        self.turn_cursor = [0] * len(scripts)  # where in its script the last turn began
        self.calls: list[int] = []  # batch size of each call

    def _match(self, sequences) -> list[int]:
        if not self.calls:
            if len(sequences) != len(self.script_ids):
                raise ValueError(f"{len(self.script_ids)} scripts for a batch of {len(sequences)} sequences")
            return list(range(len(sequences)))
        sequences = [list(seq) for seq in sequences]
        rows: list[int | None] = [None] * len(sequences)
        for i, seq in enumerate(sequences):  # exact continuations first, for every sequence
            for j, last in enumerate(self.last_sequence):
                if j not in rows and last is not None and seq[: len(last)] == last:
                    rows[i] = j
                    break
        # Then a caller that kept only the start of a turn's output (an engine stopping at an EOS id or a stop string
        # the script ran past): that script resumes where the kept part ended. The longest kept part wins, the
        # first script on a tie; a sequence that kept none of the output is no continuation.
        for i, seq in enumerate(sequences):
            if rows[i] is not None:
                continue
            cut = [(-kept, j) for j in range(len(self.script_ids)) if j not in rows and (kept := self._kept(j, seq))]
            if not cut:
                raise KeyError("sequence does not continue any scripted sequence")
            most, j = min(cut)  # most: minus the longest kept part
            self.cursor[j] = self.turn_cursor[j] - most
            self.last_sequence[j] = self.last_sequence[j][: self.turn_start[j] - most]
            rows[i] = j
        return rows

    def _kept(self, j: int, seq: list[int]) -> int | None:
        """How much of script `j`'s last output `seq` kept, where it kept only a part of it after the same input."""
        start, emitted = self.turn_start[j], self.last_emitted[j]
        if start is None or self.last_sequence[j] is None or seq[:start] != self.last_sequence[j][:start]:
            return None
        kept = 0
        while kept < len(emitted) and start + kept < len(seq) and seq[start + kept] == emitted[kept]:
            kept += 1
        return kept if kept < len(emitted) else None

    def generate_turn(self, sequences, max_new_tokens, stop_at_code_end):
        rows = self._match(sequences)
        self.calls.append(len(sequences))
        outputs = []
        for j, seq, budget, stop in zip(rows, sequences, max_new_tokens, stop_at_code_end):
            ids, emitted = self.script_ids[j], []
            self.turn_cursor[j] = self.cursor[j]
            while len(emitted) < budget:
                if self.cursor[j] >= len(ids):
                    emitted.append(self.tokenizer.eos_token_id)
                    break
                emitted.append(ids[self.cursor[j]])
                self.cursor[j] += 1
                if emitted[-1] in self.eos_token_ids and self.code_end is None:
                    break  # a turn the script ends itself (`tool_call`: the end of an assistant turn)
                if stop and self.code_end and self.code_end in self.tokenizer.decode(emitted):
                    break
            if self.step_seconds:
                time.sleep(self.step_seconds * len(emitted))
            self.last_sequence[j], self.turn_start[j], self.last_emitted[j] = [*seq, *emitted], len(seq), emitted
            outputs.append(TurnOutput(emitted, [-0.5] * len(emitted)))
        return outputs


class FakeSandbox:
    """In-process sandbox with the `retool_trl.sandbox` interface, for fast rollout tests (no isolation at all)."""

    def __init__(self, outputs: dict[str, str] | None = None):
        self.outputs = outputs or {}  # code -> forced output (else the code is really executed)
        self.batches: list[int] = []
        self.reserved: list[int] = []  # what the rollout asked `reserve` for
        self.sessions = []

    class _Session:
        def __init__(self, sandbox):
            self.sandbox, self.globals, self.closed = sandbox, {}, False

        def run(self, code: str) -> ExecResult:
            return self.sandbox.run_many([(self, code)])[0]

        def close(self):
            self.closed = True

    def reserve(self, n):
        self.reserved.append(n)

    def session(self):
        self.sessions.append(self._Session(self))
        return self.sessions[-1]

    def run_many(self, pairs):
        self.batches.append(len(pairs))
        results = []
        for session, code in pairs:
            if code in self.outputs:
                results.append(ExecResult(self.outputs[code], True, False, 0.0))
                continue
            buffer = io.StringIO()
            ok = True
            with contextlib.redirect_stdout(buffer):
                try:
                    exec(code, session.globals)
                except Exception as exc:  # noqa: BLE001 - reported to the model like an interpreter would
                    ok = False
                    buffer.write(f"{type(exc).__name__}: {exc}\n")
            results.append(ExecResult(buffer.getvalue(), ok, False, 0.0))
        return results

    def close(self):
        pass


__all__ = ["FakeSandbox", "ScriptedBackend"]
