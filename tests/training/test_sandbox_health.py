"""When sandbox failures stop a run: a call that fails twice in a burst does not, a sandbox that stays down does."""

from __future__ import annotations

import pytest

from helpers.failing_sandboxes import FailsFirst
from helpers.scripted_turns import EOS, TOKENIZER, ids_of
from retool_trl.rollout.batched import RolloutSpec


def rollout_with(health, sandbox, scripts):
    from retool_trl.rollout.batched import interleaved_rollout
    from retool_trl.testing import ScriptedBackend

    spec = RolloutSpec(max_completion_length=60, eos_token_ids=[EOS], max_tool_calls=1)
    prompts = [ids_of("Q:") for _ in scripts]
    watched = health.watch(sandbox)
    with health.step(watched):
        return interleaved_rollout(prompts, ScriptedBackend(TOKENIZER, scripts), watched, TOKENIZER, spec)


def test_one_call_failed_twice_in_a_burst_does_not_stop_the_run():
    """One rank's rollout made one code call, and it failed twice (the call and its retry in a fresh session) in a
    short burst of HTTP 429 from a busy service. Before, "every call of the rollout failed" stopped every rank of the
    job. Now the trivial cell is run again: the sandbox runs code, the run goes on (that completion unscored), and
    the next rollout runs its calls."""
    from retool_trl.training.sandbox_health import SandboxHealth

    health, sandbox = SandboxHealth("training"), FailsFirst(2)
    result = rollout_with(health, sandbox, ["<code>print(1)</code>\\boxed{1}"])
    assert result.infra_failed == [True] and sandbox.probes == 2
    result = rollout_with(health, sandbox, ["<code>print(2)</code>\\boxed{2}"])
    assert result.infra_failed == [False]


@pytest.mark.parametrize("message", ["SandboxError: worker pool lost", ""])
def test_a_sandbox_that_stays_down_still_stops_the_run(message):
    """The sandbox goes down after the probe, for good (every call fails, and the trivial cell too): the run stops
    with the sandbox's reason, also when its failures carry no message (before: an empty message was no reason, and
    the run went on without an interpreter)."""
    from retool_trl.testing import FakeSandbox
    from retool_trl.training.sandbox_health import SandboxHealth, SandboxUnavailableError

    class DownAfterProbe(FakeSandbox):
        def run_many(self, pairs):
            from retool_trl.sandbox import ExecResult

            if not self.batches:
                return super().run_many(pairs)
            self.batches.append(len(pairs))
            return [ExecResult(message, False, False, 0.0, infra_error=True) for _ in pairs]

    with pytest.raises(SandboxUnavailableError) as error:
        rollout_with(SandboxHealth("evaluation"), DownAfterProbe(), ["<code>print(1)</code>\\boxed{1}"])
    text = str(error.value)
    assert "evaluation stops" in text and (message or "without a message") in text and "\n" not in text
