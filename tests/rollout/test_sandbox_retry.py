"""A sandbox call that fails for the sandbox's own reasons is retried in a fresh session with the earlier cells
replayed."""

from helpers.testing_utils import (
    FakeSandbox,
    ScriptedBackend,
    make_char_tokenizer,
)
from retool_trl.rollout.batched import RolloutSpec, interleaved_rollout
from retool_trl.sandbox import ExecResult

TOKENIZER = make_char_tokenizer()


def rollout(scripts, sandbox=None, tokenizer=TOKENIZER, **spec):
    prompts = [tokenizer("Q:", add_special_tokens=False)["input_ids"] for _ in scripts]
    spec = RolloutSpec(max_completion_length=200, eos_token_ids=[tokenizer.eos_token_id], **spec)
    return interleaved_rollout(prompts, ScriptedBackend(tokenizer, scripts), sandbox or FakeSandbox(), tokenizer, spec)


class BreakingSandbox(FakeSandbox):
    """Like LocalSandbox: an infrastructure failure breaks the session for good (later calls say so)."""

    def __init__(self):
        super().__init__()
        self.fail_next = False
        self.broken = set()

    def run_many(self, pairs):
        results = []
        for session, code in pairs:
            if id(session) in self.broken:
                results.append(ExecResult("SessionError: session was reset", False, False, 0.0))
            elif self.fail_next and "y" in code:
                self.fail_next = False
                self.broken.add(id(session))
                results.append(ExecResult("SandboxError: worker lost", False, False, 0.0, infra_error=True))
            else:
                results.extend(super().run_many([(session, code)]))
        return results


def test_retry_uses_a_fresh_session_with_the_earlier_cells_replayed():
    sandbox = BreakingSandbox()
    sandbox.fail_next = True
    result = rollout(["<code>x = 40</code>a<code>y = x + 2\nprint(y)</code>\\boxed{42}"], sandbox=sandbox)
    env = TOKENIZER.decode([t for t, m in zip(result.completion_ids[0], result.interpreter_mask[0]) if not m])
    assert env.endswith("<interpreter>42\n</interpreter>")  # state of cell 1 was restored in the new session
    assert result.infra_failed == [False] and result.num_tool_errors == [0]
