"""The interleaved rollout and its interpreter mask (DESIGN §3-4), with a scripted backend and an in-process
sandbox."""

import random

import pytest

from helpers.testing_utils import (
    FakeSandbox,
    ScriptedBackend,
    assert_rollout_invariants,
    make_bpe_tokenizer,
    make_char_tokenizer,
)
from retool_trl.rollout import RolloutSpec, interleaved_rollout

TOKENIZERS = {
    "char": lambda: make_char_tokenizer(extra_chars="é∑数学ö"),
    "bpe_small": lambda: make_bpe_tokenizer(vocab_size=270),  # tags split over several tokens
    "bpe_merged": lambda: make_bpe_tokenizer(vocab_size=400),  # tags inside longer tokens, e.g. ")</code>\n"
}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request):
    return TOKENIZERS[request.param]()


def run(tokenizer, scripts, max_len=400, sandbox=None, **spec_kwargs):
    # Identical prompts, as in a GRPO group: sequences must still be kept apart.
    prompts = [tokenizer("Q: ", add_special_tokens=False)["input_ids"] for _ in scripts]
    backend = ScriptedBackend(tokenizer, scripts)
    sandbox = sandbox or FakeSandbox()
    spec = RolloutSpec(max_completion_length=max_len, eos_token_ids=[tokenizer.eos_token_id], **spec_kwargs)
    return interleaved_rollout(prompts, backend, sandbox, tokenizer, spec), backend, sandbox


def test_two_calls_are_stateful_and_masked(tokenizer):
    script = "Compute.<code>x = 6 * 7\nprint(x)</code>\nAgain <code>print(x + 1)</code> so \\boxed{43}."
    result, _, _ = run(tokenizer, [script])
    assert_rollout_invariants(result, tokenizer, [script], 400)
    assert result.num_tool_calls == [2] and result.num_tool_errors == [0]
    ids, mask = result.completion_ids[0], result.interpreter_mask[0]
    env = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert env == "<interpreter>42\n</interpreter><interpreter>43\n</interpreter>"
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert full.index("<interpreter>42") > full.index("print(x)</code>")


def test_fenced_code_unicode_and_empty_output(tokenizer):
    script = "A<code>```python\nprint('∑ 数学 é')\n```</code>B<code>y = 1</code>C \\boxed{1}"
    result, _, _ = run(tokenizer, [script])
    assert_rollout_invariants(result, tokenizer, [script], 400)
    env = tokenizer.decode([t for t, m in zip(result.completion_ids[0], result.interpreter_mask[0]) if not m])
    assert "<interpreter>∑ 数学 é\n</interpreter>" in env and "<interpreter></interpreter>" in env
    assert result.num_tool_calls == [2]


def test_long_output_is_truncated_in_the_middle(tokenizer):
    script = "<code>print('a' * 3000 + 'END')</code>done"
    result, _, _ = run(tokenizer, [script], max_len=2000, max_interpreter_output_chars=64)
    assert_rollout_invariants(result, tokenizer, [script], 2000)
    env = tokenizer.decode([t for t, m in zip(result.completion_ids[0], result.interpreter_mask[0]) if not m])
    body = env[len("<interpreter>") : -len("</interpreter>")]
    assert len(body) <= 64 and body.startswith("aaa") and body.rstrip().endswith("END")


def test_code_end_without_code_start_is_text(tokenizer):
    script = "oops</code> and then \\boxed{2}"
    result, backend, sandbox = run(tokenizer, [script])
    assert_rollout_invariants(result, tokenizer, [script], 400)
    assert result.num_tool_calls == [0] and sandbox.batches == []
    assert set(result.interpreter_mask[0]) == {1}


def test_max_tool_calls_stops_execution_and_stopping(tokenizer):
    script = "<code>print(1)</code>a<code>print(2)</code>b<code>print(3)</code>c"
    result, backend, _ = run(tokenizer, [script], max_tool_calls=2)
    assert_rollout_invariants(result, tokenizer, [script], 400)
    assert result.num_tool_calls == [2]
    # Third block: no stop, no execution; the rest of the script came in the same turn.
    assert len(backend.calls) == 3
    full = tokenizer.decode(result.completion_ids[0], skip_special_tokens=True)
    assert full.endswith("<code>print(3)</code>c")


def test_zero_tool_calls_is_text_only(tokenizer):
    script = "<code>print(1)</code>x"
    result, backend, sandbox = run(tokenizer, [script], max_tool_calls=0)
    assert result.num_tool_calls == [0] and sandbox.batches == [] and len(backend.calls) == 1
    assert set(result.interpreter_mask[0]) == {1}


def test_truncated_inside_code(tokenizer):
    script = "<code>print(" + "1 + " * 50 + "1)</code>done"
    script_len = len(tokenizer(script, add_special_tokens=False)["input_ids"])
    max_len = script_len // 2
    result, _, sandbox = run(tokenizer, [script], max_len=max_len)
    assert_rollout_invariants(result, tokenizer, [script], max_len)
    assert len(result.completion_ids[0]) == max_len and result.num_tool_calls == [0]
    assert set(result.interpreter_mask[0]) == {1} and sandbox.batches == []


def test_truncated_inside_interpreter_output(tokenizer):
    script = "<code>print('z' * 200)</code>after"
    code_len = len(tokenizer("<code>print('z' * 200)</code>", add_special_tokens=False)["input_ids"])
    max_len = code_len + 10
    result, _, _ = run(tokenizer, [script], max_len=max_len)
    assert_rollout_invariants(result, tokenizer, [script], max_len)
    ids, mask = result.completion_ids[0], result.interpreter_mask[0]
    assert len(ids) == max_len and mask[-1] == 0 and result.num_tool_calls == [1]
    assert tokenizer.eos_token_id not in ids


def test_errors_are_reported_and_counted(tokenizer):
    script = "<code>1/0</code>x<code>print(undefined_name)</code>y"
    result, _, _ = run(tokenizer, [script])
    assert_rollout_invariants(result, tokenizer, [script], 400)
    assert result.num_tool_calls == [2] and result.num_tool_errors == [2]
    env = tokenizer.decode([t for t, m in zip(result.completion_ids[0], result.interpreter_mask[0]) if not m])
    assert "ZeroDivisionError" in env and "NameError" in env


def test_batch_executes_concurrently_and_resumes_only_callers():
    tokenizer = make_char_tokenizer()
    scripts = ["<code>print(1)</code>a", "no code b", "<code>print(2)</code>c", "plain \\boxed{3}"]
    result, backend, sandbox = run(tokenizer, scripts)
    assert_rollout_invariants(result, tokenizer, scripts, 400)
    assert sandbox.batches == [2]  # both pending snippets of the batch in one run_many call
    assert backend.calls == [4, 2]  # only the two sequences that called code are continued
    assert result.num_tool_calls == [1, 0, 1, 0]
    # Each completion has its own session: state never leaks between completions.
    assert len(sandbox.sessions) == 2 and all(s.closed for s in sandbox.sessions)


def test_sandbox_failure_does_not_stop_the_rollout():
    class BrokenSandbox(FakeSandbox):
        def run_many(self, pairs):
            raise ConnectionError("service down")

    tokenizer = make_char_tokenizer()
    script = "<code>print(1)</code>then \\boxed{1}"
    result, _, _ = run(tokenizer, [script], sandbox=BrokenSandbox())
    assert_rollout_invariants(result, tokenizer, [script], 400)
    assert result.num_infra_errors == [1] and result.num_tool_errors == [1]
    assert "SandboxError" in tokenizer.decode(result.completion_ids[0])


@pytest.mark.parametrize("seed", range(6))
def test_random_scripts_keep_invariants(tokenizer, seed):
    rng = random.Random(seed)
    pieces = ["Let ", "x", " = ", "∑ ", "é", "<code>", "</code>", "print(", "7*6", ")", "\n", "\\boxed{", "}", "数学 "]
    scripts = []
    for _ in range(5):
        parts = [rng.choice(pieces) for _ in range(rng.randint(0, 25))]
        if rng.random() < 0.7:
            parts.insert(rng.randint(0, len(parts)), "<code>print(len('abc'))</code>")
        scripts.append("".join(parts))
    if not isinstance(tokenizer.backend_tokenizer.model, type(make_char_tokenizer().backend_tokenizer.model)):
        max_len = rng.randint(5, 80)
    else:
        max_len = rng.randint(5, 300)
    result, _, _ = run(tokenizer, scripts, max_len=max_len, max_tool_calls=rng.randint(0, 3))
    assert_rollout_invariants(result, tokenizer, scripts, max_len)


def test_the_rollout_reserves_sessions_only_when_code_can_run():
    """A GRPO step reserves its batch of sessions before the first turn, and again once its sessions are closed (the
    next step's jails set up while the trainer updates); a text-only run (max_tool_calls=0) starts no sandbox at
    all."""
    from retool_trl.sandbox import RemoteSandbox
    from retool_trl.sandbox.cell_limits import CellLimits

    tokenizer = make_char_tokenizer()
    scripts = ["<code>print(1)</code>\\boxed{1}", "\\boxed{2}"]
    prompts = [tokenizer("Q:", add_special_tokens=False)["input_ids"]] * 2

    class Watching(FakeSandbox):  # what was still open at each reservation
        def reserve(self, n):
            super().reserve(n)
            self.open_at_reserve = [*getattr(self, "open_at_reserve", []), sum(not s.closed for s in self.sessions)]

    for calls, expected in ((2, [2, 2]), (0, [])):
        sandbox = Watching()
        spec = RolloutSpec(max_completion_length=64, eos_token_ids=[tokenizer.eos_token_id], max_tool_calls=calls)
        interleaved_rollout(prompts, ScriptedBackend(tokenizer, scripts), CellLimits(sandbox, 16), tokenizer, spec)
        assert sandbox.reserved == expected
        if calls:  # before any session, and for the next step once every session of this one is closed
            assert sandbox.open_at_reserve == [0, 0] and len(sandbox.sessions) == 1
    RemoteSandbox("http://127.0.0.1:9").reserve(4)  # part of the interface: nothing to prepare remotely


def test_cell_limits_is_an_ordinary_object():
    """copy and pickle build the wrapper without running __init__: attribute look-ups must not recurse or KeyError."""
    import copy

    from retool_trl.sandbox.cell_limits import CellLimits

    wrapped = copy.copy(CellLimits(FakeSandbox(), 10))
    assert wrapped.max_cell_chars == 10 and wrapped.run_many([]) == []
    assert not hasattr(CellLimits.__new__(CellLimits), "num_workers")
