"""Scripted models and a thread-safe fake sandbox for the async rollout's tests (and the tests that reuse its
workload)."""

import asyncio
import threading
import time

from helpers.testing_utils import make_char_tokenizer
from retool_trl.rollout.batched import RolloutSpec
from retool_trl.rollout.per_completion import EngineError
from retool_trl.sandbox import ExecResult
from retool_trl.testing import ScriptedBackend

TOKENIZER = make_char_tokenizer()


SCRIPTS = [
    "<code>x = 6 * 7\nprint(x)</code>so<code>print(x + 1)</code>\\boxed{42}",
    "\\boxed{41}",
    "<code>slow(0.3)\nprint(1)</code>then<code>print(2)</code>and<code>print(3)</code>\\boxed{3}",
    "stray</code>then <code>1/0</code>oops \\boxed{0}",
]


class AsyncScripted:
    """An async engine writing fixed scripts (the barrier loop's `ScriptedBackend`, one sequence per request), with
    a delay per token; records when each request starts and ends."""

    def __init__(self, scripts, seconds_per_token=0.0, fail_on=None):
        self.scripted = ScriptedBackend(TOKENIZER, scripts)
        self.scripted.calls.append(0)  # match every request by its sequence, as for a continued turn
        self.scripted.last_sequence = [TOKENIZER("Q:", add_special_tokens=False)["input_ids"] for _ in scripts]
        self.delay = seconds_per_token
        self.fail_on = fail_on  # (row, turn) whose request fails
        self.lock = threading.Lock()
        self.events: list[tuple[str, int, float]] = []
        self.turns = [0] * len(scripts)

    async def generate(self, token_ids, max_tokens, stop_at_code_end):
        with self.lock:
            row = self.scripted._match([token_ids])[0]
            self.turns[row] += 1
            self.events.append(("request", row, time.monotonic()))
            if self.fail_on == (row, self.turns[row]):
                raise EngineError("ConnectError: connection dropped")
            saved = self.scripted.calls
            [out] = self.scripted.generate_turn([token_ids], [max_tokens], [stop_at_code_end])
            self.scripted.calls = saved
        await asyncio.sleep(self.delay * len(out.token_ids))
        return out


class ThreadSafeSandbox:
    """Runs cells in-process with real `exec` and its own stdout per session; `slow(s)` sleeps `s` seconds."""

    def __init__(self):
        self.events: list[tuple[str, str, float]] = []
        self.lock = threading.Lock()

    class _Session:
        def __init__(self, sandbox):
            self.sandbox, self.closed, self.out = sandbox, False, []
            self.globals = {"print": lambda *a: self.out.append(" ".join(map(str, a)) + "\n"), "slow": time.sleep}

        def close(self):
            self.closed = True

    def session(self):
        return self._Session(self)

    def run_many(self, pairs):
        results = []
        for session, code in pairs:
            with self.lock:
                self.events.append(("start", code, time.monotonic()))
            session.out.clear()
            try:
                exec(code, session.globals)
                results.append(ExecResult("".join(session.out), True, False, 0.0))
            except Exception as exc:  # noqa: BLE001
                results.append(ExecResult("".join(session.out) + f"{type(exc).__name__}: {exc}\n", False, False, 0.0))
            with self.lock:
                self.events.append(("end", code, time.monotonic()))
        return results

    def close(self):
        pass


def prompts(n):
    return [TOKENIZER("Q:", add_special_tokens=False)["input_ids"] for _ in range(n)]


SPEC = RolloutSpec(max_completion_length=200, eos_token_ids=[TOKENIZER.eos_token_id], max_tool_calls=4)
