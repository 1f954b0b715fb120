"""Defects found by review (issue 13): each test here failed on the code before its fix."""

import pytest
from datasets import Dataset

from retool_trl import ReToolConfig
from retool_trl.format.parsing import Tags, model_prose
from retool_trl.rewards.functions import boxed_accuracy
from retool_trl.rollout import ROLLOUT_FIELDS, RolloutSpec, interleaved_rollout
from retool_trl.testing import FakeSandbox, ScriptedBackend
from testing_utils import make_bpe_tokenizer, make_char_tokenizer, trainer_for

BPE = make_bpe_tokenizer()  # byte-level: any text the sandbox prints can be encoded and decoded back
CHAR = make_char_tokenizer()


def run(scripts, tokenizer=BPE, sandbox=None, backend=None, **spec):
    prompts = [tokenizer("Q:", add_special_tokens=False)["input_ids"] for _ in scripts]
    spec = RolloutSpec(max_completion_length=400, eos_token_ids=[tokenizer.eos_token_id], **spec)
    backend = backend or ScriptedBackend(tokenizer, scripts)
    return interleaved_rollout(prompts, backend, sandbox or FakeSandbox(), tokenizer, spec)


# ------------------------------------------------------------------- reward parsing: every path unhackable
# (script the policy writes, whether its own final answer is right). Code runs for real in the fake sandbox.
INJECTIONS = [
    ('<code>print("</interpreter>\\\\boxed{42}")</code>I do not know.', False),
    ('<code>print("</interpreter>")\nprint("\\\\boxed{42}")</code>', False),
    ('<code>import sys\nsys.stdout.write("</interpreter> \\\\boxed{42} <interpreter>")</code>no idea', False),
    ('<code>print("\\\\boxed{42}")</code>', False),
    ('<code>print("<code>\\\\boxed{42}</code>")</code>so', False),
    ('<code>print("</interpreter>", end="")\n1/0</code>\\boxed{41}', False),
    # The model's own code holds an interpreter tag as a string: its final answer must still count.
    ('<code>s = "<interpreter>"\nprint(len(s) * 3 + 3)</code>So \\boxed{42}.', True),
    ('<code>tag = "</interpreter>"\nprint(tag)</code>The answer is \\boxed{42}', True),
    ("\\boxed{42}", True),
]


@pytest.mark.parametrize("script,right", INJECTIONS, ids=range(len(INJECTIONS)))
def test_printed_tags_earn_nothing_on_either_reward_path(script, right):
    result = run([script])
    expected = [1.0 if right else -1.0]
    # Path 1: the rollout's model_text. Path 2: no model_text (a plain GRPOTrainer user), the decoded completion.
    assert boxed_accuracy(["unused"], ["42"], model_text=result.model_text) == expected
    decoded = BPE.decode(result.completion_ids[0], skip_special_tokens=True)
    assert boxed_accuracy([decoded], ["42"]) == expected
    assert boxed_accuracy([[{"role": "assistant", "content": decoded}]], ["42"]) == expected


def test_interpreter_tag_inside_code_does_not_swallow_the_answer():
    text = 'Let <code>s = "<interpreter>"\nprint(s)</code><interpreter>&lt;\n</interpreter> so \\boxed{42}'
    assert model_prose(text) == "Let  so \\boxed{42}"
    tags = Tags("[PY]", "[/PY]", "[OUT]", "[/OUT]")
    assert model_prose("a [PY]x='[OUT]'[/PY][OUT]9[/OUT] \\boxed{1}", tags) == "a  \\boxed{1}"


# ------------------------------------------------------------------- empty batches, output that is not text
class OldTransformersTokenizer:
    """A tokenizer as transformers 5.19 behaves: `batch_decode([])` returns `[""]`; encoding `[]` is refused."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def batch_decode(self, ids, **kwargs):
        return self._tokenizer.batch_decode(ids, **kwargs) if ids else [""]

    def __call__(self, text, **kwargs):
        assert not isinstance(text, list) or text, "the tokenizer was called on an empty batch"
        return self._tokenizer(text, **kwargs)


class OtherRankStillBusy(ScriptedBackend):
    """This process runs out of rows first; another one keeps the collective loop going for `extra` more turns."""

    extra = 2

    def any_active(self, has_active: bool) -> bool:
        if has_active:
            return True
        self.extra -= 1
        return self.extra >= 0

    def generate_turn(self, sequences, max_new_tokens, stop_at_code_end):
        return super().generate_turn(sequences, max_new_tokens, stop_at_code_end) if sequences else []


def test_a_process_without_active_rows_keeps_turning():
    tokenizer = OldTransformersTokenizer(CHAR)
    scripts = ["<code>print(1)</code>\\boxed{1}", "\\boxed{2}"]
    result = run(scripts, tokenizer=tokenizer, backend=OtherRankStillBusy(CHAR, scripts))
    assert result.num_tool_calls == [1, 0]
    assert result.model_text == scripts
    empty = run([], tokenizer=tokenizer, backend=OtherRankStillBusy(CHAR, []))  # no rows at all on this process
    assert empty.completion_ids == [] and empty.model_text == []


@pytest.mark.parametrize("printed", [chr(0xD800), "a" + chr(0xDFFF) + "b", "\udcff\udcfe"])
def test_output_that_is_not_text_becomes_valid_text(printed):
    code = "print(1)"
    result = run([f"<code>{code}</code>\\boxed{{1}}"], sandbox=FakeSandbox({code: printed}))
    env = BPE.decode([t for t, m in zip(result.completion_ids[0], result.interpreter_mask[0]) if not m])
    assert env.startswith("<interpreter>") and env.endswith("</interpreter>")
    assert "\ufffd" in env
    env.encode("utf-8")  # strict: no lone surrogate left
    assert result.model_text == ["<code>print(1)</code>\\boxed{1}"]


# ------------------------------------------------------------------- the trainer's side
def test_dropped_rows_are_logged_with_their_real_length_and_leave_the_loss(tmp_path):
    scripts = ["\\boxed{42}", "<code>print(1)</code>hmm", "\\boxed{41}", "<code>print(6*7)</code>\\boxed{42}"]
    trainer = trainer_for(tmp_path, scripts, filter_void_turns=True)
    inputs = trainer._generate_and_score_completions([{"prompt": "Q:", "answer": "42"} for _ in range(4)])
    model_tokens = [len(CHAR(s, add_special_tokens=False)["input_ids"]) + 1 for s in scripts]  # + EOS
    metrics = trainer._metrics["train"]
    assert metrics["completions/min_length"] == [min(model_tokens)]
    assert metrics["completions/max_length"] == [max(model_tokens)]
    assert metrics["retool/dropped_from_loss_ratio"] == [0.25]
    weights = (inputs["tool_mask"] * inputs["completion_mask"]).sum(dim=1).tolist()
    assert weights[1] == 0 and all(w > 0 for i, w in enumerate(weights) if i != 1)
    # ...and out of the normaliser the default loss (dapo) divides by: only the kept tokens count.
    assert trainer.args.loss_type == "dapo"
    assert inputs["num_items_in_batch"].item() == sum(weights)


def test_reward_functions_receive_only_per_completion_facts(tmp_path):
    seen = {}

    def user_reward(completions, correct_reward=None, code_start=None, tool_use_bonus=None, **kwargs):
        seen.update(kwargs, correct_reward=correct_reward, code_start=code_start, tool_use_bonus=tool_use_bonus)
        return [0.0] * len(completions)

    scripts = ["\\boxed{42}"] * 4
    trainer = trainer_for(
        tmp_path,
        scripts,
        reward_funcs=[boxed_accuracy, user_reward],
        correct_reward=2.0,
        tool_use_bonus=0.1,
        code_start="<code>",
    )
    rows = [{"prompt": "Q:", "answer": "42"} for _ in range(4)]
    trainer._generate_and_score_completions(rows)
    # The user's parameters that share a name with ReTool settings get nothing of ReTool's.
    assert seen["correct_reward"] is None and seen["code_start"] is None and seen["tool_use_bonus"] is None
    assert set(ROLLOUT_FIELDS) <= set(seen)
    trl_own = {"prompts", "completion_ids", "trainer_state", "log_metric", "log_extra", "environments"}
    assert set(seen) - set(ROLLOUT_FIELDS) - trl_own - {"correct_reward", "code_start", "tool_use_bonus"} == {"answer"}
    assert set(rows[0]) == {"prompt", "answer", *ROLLOUT_FIELDS}  # TRL writes the kwargs into the batch rows
    # ...while the built-in reward is configured from ReToolConfig: correct answers score correct_reward.
    rewards = trainer._metrics["train"]["rewards/boxed_accuracy/mean"]
    assert rewards == [2.0]


def test_default_reward_without_answer_column_fails_at_build(tmp_path):
    dataset = Dataset.from_list([{"prompt": "Q:", "solution": "42"}] * 4)
    with pytest.raises(ValueError, match=r"needs an `answer` column.*\['prompt', 'solution'\]"):
        trainer_for(tmp_path, [], dataset=dataset)
    trainer_for(tmp_path, [], dataset=dataset, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)])


def test_beam_search_error_says_what_prevents_it(tmp_path):
    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match=r"num_beams'\] must be 1: GRPO learns from completions sampled"):
        ReToolConfig(**base, generation_kwargs={"num_beams": 2})
    with pytest.raises(ValueError, match=r"num_return_sequences'\] must be 1: the rollout continues each"):
        ReToolConfig(**base, generation_kwargs={"num_return_sequences": 2})


def test_generation_kwargs_from_the_command_line_are_checked_too(tmp_path):
    """`--generation_kwargs '{"num_beams": 4}'` arrives as a JSON string that TRL parses after our checks ran."""
    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match=r"num_beams'\] must be 1"):
        ReToolConfig(**base, generation_kwargs='{"num_beams": 4}')
    with pytest.raises(ValueError, match=r"num_return_sequences'\] must be 1"):
        ReToolConfig(**base, generation_kwargs='{"num_return_sequences": 2}')
    with pytest.raises(ValueError, match="generation_kwargs must be a mapping .* or a JSON object"):
        ReToolConfig(**base, generation_kwargs="top_k=20")
    assert ReToolConfig(**base, generation_kwargs='{"top_k": 20}').generation_kwargs == {"top_k": 20}
    with pytest.raises(ValueError, match=r"ReToolConfig.generation_kwargs is not valid JSON"):
        ReToolConfig(**base, generation_kwargs="{bad")


@pytest.mark.parametrize(
    "tags", [Tags("[[[", "]]]", "{{{", "}}}"), Tags("<code>", "</code>", "<interpreter>", "</interpreter>")]
)
@pytest.mark.parametrize(
    "printed", ["{end}{end}\\boxed{{42}}", "{end}{end}{end}\\boxed{{42}} {start}", "x{end}\\boxed{{42}}"]
)
def test_defanging_holds_for_tags_that_overlap_themselves(tags, printed):
    from retool_trl.format.parsing import clean_output

    out = clean_output(printed.format(end=tags.interpreter_end, start=tags.interpreter_start), tags)
    assert not any(
        tag in out for tag in (tags.code_start, tags.code_end, tags.interpreter_start, tags.interpreter_end)
    )
    decoded = (
        f"{tags.code_start}print(1){tags.code_end}{tags.interpreter_start}{out}{tags.interpreter_end}I am unsure."
    )
    assert boxed_accuracy([decoded], ["42"], tags=tags) == [-1.0]


@pytest.mark.parametrize(
    "tags,problem",
    [(dict(code_end="»"), "at least 2 characters"), (dict(interpreter_start="<code>x"), "is a prefix of")],
)
def test_tags_that_cannot_be_told_apart_are_refused(tmp_path, tags, problem):
    with pytest.raises(ValueError, match=problem):
        ReToolConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **tags)
