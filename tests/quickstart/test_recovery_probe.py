"""The multi-turn quickstart's recovery probe: every held-out completion starts from a failing cell to repair."""

import json
import re
from types import SimpleNamespace

import pytest

from retool_trl.data.synthetic_multiturn import (
    FAILURES,
    MULTITURN_CELL_CHARS,
    make_multiturn_splits,
    multiturn_cells,
    multiturn_trace,
    sample_multiturn_problems,
)
from retool_trl.quickstart import QuickstartArguments, rl_config
from retool_trl.quickstart.multiturn import (
    MULTITURN_DEFAULTS,
    MultiturnTask,
    multiturn_model_path,
    multiturn_table,
    recovery_probe,
    recovery_probe_prompts,
)
from retool_trl.sandbox import build_sandbox
from retool_trl.sandbox.cell_limits import CellLimits
from retool_trl.testing import ScriptedBackend

FAILING_CELL = re.compile(r"<code>([^<]*)</code><interpreter>([^<]*)</interpreter>$")


@pytest.fixture(scope="module")
def sandbox():
    sandbox = build_sandbox("local", num_workers=1, timeout_s=5.0)
    yield sandbox
    sandbox.close()


@pytest.fixture(scope="module")
def held_out():
    return make_multiturn_splits(1, 10, seed=4)["test"]


def test_probe_prompts_end_with_the_cell_and_the_reply_the_interpreter_gives(sandbox, held_out):
    """The forced prefix is what the model would see had it written the failing cell itself: the cold start's
    failing cell and, byte for byte, the reply of the quickstart's interpreter (cells over 16 characters refused,
    errors as their last line) in a fresh session, which the cell leaves as it found it."""
    interpreter = CellLimits(sandbox, MULTITURN_CELL_CHARS, errors="last_line")
    probe = recovery_probe_prompts(held_out)
    assert len(probe) == len(held_out) and probe["answer"] == held_out["answer"]
    assert probe["failure"] == [FAILURES[i % len(FAILURES)] for i in range(len(held_out))]
    assert set(probe["failure"]) == set(FAILURES)
    problems = {p.expression: p for p in sample_multiturn_problems(10, seed=5, split="test")}
    for row, original in zip(probe, held_out):
        assert row["prompt"] == original["prompt"] + row["failing_cell"]
        code, shown = FAILING_CELL.search(row["prompt"]).groups()
        problem = problems[row["expression"]]
        # The cold-start trace of this failure writes the same cell and shows the same reply.
        assert f"<code>{code}</code><interpreter>{shown}</interpreter>" in multiturn_trace(problem, row["failure"])
        session, fresh = interpreter.session(), interpreter.session()
        try:
            names = "print(sorted(globals()))"
            failed, after = interpreter.run_many([(session, code), (session, names)])
            (untouched,) = interpreter.run_many([(fresh, names)])
        finally:
            session.close()
            fresh.close()
        assert not failed.ok and not failed.infra_error
        assert failed.output == shown, row["failure"]
        assert after.output == untouched.output  # nothing was defined by the failing cell


class _ScriptsByPrompt:
    """A stand-in for the transformers backend: on its first turn it picks each sequence's script from the decoded
    prompt (`script_for(prompt_text)`), then writes it like `ScriptedBackend` does."""

    def __init__(self, tokenizer, script_for, seen):
        self.tokenizer, self.script_for, self.seen, self.inner = tokenizer, script_for, seen, None

    def generate_turn(self, sequences, max_new_tokens, stop_at_code_end):
        if self.inner is None:
            prompts = [self.tokenizer.decode(seq, skip_special_tokens=True) for seq in sequences]
            self.seen.extend(zip(prompts, max_new_tokens))
            self.inner = ScriptedBackend(self.tokenizer, [self.script_for(p) for p in prompts])
        return self.inner.generate_turn(sequences, max_new_tokens, stop_at_code_end)


def test_a_scripted_repair_counts_as_recovered_and_a_give_up_does_not(sandbox, held_out, tmp_path, monkeypatch):
    """A model that reads the error and writes the two cells recovers; one that gives up and guesses does not (only
    the answer the model writes counts); one that wastes cells first gets one call fewer than a completion of its
    own would (the forced cell was one of them)."""
    from transformers import AutoTokenizer

    import retool_trl.evaluation.inference as inference

    tokenizer = AutoTokenizer.from_pretrained(multiturn_model_path(), padding_side="left")
    task = MultiturnTask()
    config = rl_config(
        QuickstartArguments(task="multiturn", **MULTITURN_DEFAULTS),
        tmp_path,
        True,
        max_tool_calls=task.max_tool_calls,
        max_interpreter_output_chars=task.max_interpreter_output_chars,
        max_cell_chars=task.max_cell_chars,
        interpreter_errors="last_line",
    )
    problems = {p.expression: p for p in sample_multiturn_problems(10, seed=5, split="test")}
    plan = {}  # expression -> what the stand-in model does after the failing cell
    for i, expression in enumerate(held_out["expression"]):
        plan[expression] = ("repair", "give_up", "repair", "overrun", "give_up")[i % 5]

    def script_for(prompt: str) -> str:
        expression = re.match(r"What is (.*?)\?", prompt).group(1)
        problem = problems[expression]
        first, second = multiturn_cells(problem)
        repair = f"<code>{first}</code><code>{second}</code>\\boxed{{{problem.answer}}}"
        return {
            "repair": repair,
            "give_up": f"\\boxed{{{problem.answer + 1}}}",
            "overrun": "<code>x=1</code><code>x=2</code>" + repair,  # 4 cells: the last one no longer runs
        }[plan[expression]]

    seen = []
    monkeypatch.setattr(inference, "TransformersBackend", lambda *args: _ScriptsByPrompt(tokenizer, script_for, seen))
    model = SimpleNamespace(generation_config=None)
    figures = recovery_probe(model, tokenizer, held_out, config, sandbox, seed=0, when="after")

    # Every probe prompt the model saw ends with its failing cell, and its budget leaves room for that cell.
    probe = recovery_probe_prompts(held_out)
    assert sorted(p for p, _ in seen) == sorted(probe["prompt"])
    for prompt, budget in seen:
        cell = probe["failing_cell"][probe["prompt"].index(prompt)]
        assert prompt.endswith(cell)
        assert budget == config.max_completion_length - len(tokenizer(cell, add_special_tokens=False)["input_ids"])
    samples = [json.loads(line) for line in (tmp_path / "probe_after_samples.jsonl").read_text().splitlines()]
    assert [s["problem"] for s in samples] == list(range(len(held_out)))
    outcome = {held_out["expression"][s["problem"]]: s for s in samples}
    for expression, behaviour in plan.items():
        sample = outcome[expression]
        assert sample["correct"] == (behaviour != "give_up"), (behaviour, sample["completion"])
        assert sample["failure"] == FAILURES[held_out["expression"].index(expression) % len(FAILURES)]
        if behaviour == "repair":
            assert sample["num_tool_calls"] == 2 and sample["num_tool_errors"] == 0
        if behaviour == "overrun":  # x=1, x=2, a=...; `print(a+...)` is past max_tool_calls - 1 and never runs
            assert sample["num_tool_calls"] == task.max_tool_calls - 1
            assert str(held_out["answer"][sample["problem"]]) + "\n" not in sample["completion"]
    repaired = sum(b != "give_up" for b in plan.values())
    n = len(held_out)
    assert figures["recovery_probe_n"] == n
    assert figures["recovery_probe_after"] == pytest.approx(repaired / n)
    assert figures["recovery_probe_stderr_after"] == pytest.approx((repaired / n * (1 - repaired / n) / n) ** 0.5)
    for failure in FAILURES:
        kinds = [b for e, b in plan.items() if outcome[e]["failure"] == failure]
        assert figures["recovery_probe_by_failure_after"][failure] == pytest.approx(
            sum(b != "give_up" for b in kinds) / len(kinds)
        )


def test_probe_is_skipped_without_the_interpreter_and_the_table_says_so(held_out, tmp_path):
    """Text-only RL never runs a cell, so there is nothing to repair: no probe figures, and the table shows why."""
    config = rl_config(QuickstartArguments(task="multiturn", **MULTITURN_DEFAULTS), tmp_path, False)
    assert recovery_probe(None, None, held_out, config, None, seed=0, when="before") == {}
    run = {
        "accuracy_before": 0.5,
        "accuracy_after": 0.9,
        "calls_per_completion_before": 2.0,
        "calls_per_completion_after": 2.1,
        "recovery_rate_before": 0.5,
        "failing_completions_before": 30,
        "recovery_rate_after": 1.0,
        "failing_completions_after": 13,
        "train_s": 100,
    }
    probed = {
        "recovery_probe_before": 0.55,
        "recovery_probe_after": 0.875,
        "recovery_probe_stderr_before": 0.031,
        "recovery_probe_stderr_after": 0.0207,
        "recovery_probe_n": 256,
    }
    table = multiturn_table({"tool_rl": {**run, **probed}, "text_rl": run})
    tool_line, text_line = table.splitlines()[1:]
    assert "55.0% -> 87.5% (256, ± 3.1% -> 2.1%)" in tool_line
    assert "- (no interpreter)" in text_line


def test_probe_prompt_ids_are_those_the_rollout_builds_for_a_cell_the_model_wrote(held_out, tmp_path):
    """The model sees, token for token, what it would have seen had it written the failing cell itself: the prompt's
    ids, the cell as it would be sampled, then the interpreter block as the rollout splices it in. (A tokenizer that
    merged across the prompt/cell boundary, or added a token at the end of a prompt, would break this.)"""
    from transformers import AutoTokenizer

    from retool_trl.data.prompt_ids import tokenize_prompts
    from retool_trl.rollout import RolloutSpec
    from retool_trl.rollout.rows import interpreter_blocks

    tokenizer = AutoTokenizer.from_pretrained(multiturn_model_path(), padding_side="left")
    config = rl_config(QuickstartArguments(task="multiturn", **MULTITURN_DEFAULTS), tmp_path, True, max_tool_calls=4)
    spec = RolloutSpec.from_config(config, [tokenizer.eos_token_id])
    probe = recovery_probe_prompts(held_out)
    probed = tokenize_prompts(tokenizer, probe["prompt"], config)
    plain = tokenize_prompts(tokenizer, held_out["prompt"], config)
    for ids, prompt_ids, cell in zip(probed, plain, probe["failing_cell"]):
        code, output = FAILING_CELL.search(cell).groups()
        written = tokenizer(f"<code>{code}</code>", add_special_tokens=False)["input_ids"]
        (block,) = interpreter_blocks(tokenizer, [output], spec)
        assert ids == prompt_ids + written + block
