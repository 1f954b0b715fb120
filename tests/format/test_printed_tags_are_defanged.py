"""What code prints cannot pass for the model's own markup: printed tags (also tags that overlap themselves) earn
nothing on either reward path, an interpreter tag inside code does not swallow the answer, and output that is not
text becomes valid text."""

import pytest

from helpers.testing_utils import (
    FakeSandbox,
    ScriptedBackend,
    make_bpe_tokenizer,
    make_char_tokenizer,
)
from retool_trl.format.parsing import Tags, model_prose
from retool_trl.rewards.functions import boxed_accuracy
from retool_trl.rollout.batched import RolloutSpec, interleaved_rollout

BPE = make_bpe_tokenizer()  # byte-level: any text the sandbox prints can be encoded and decoded back


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


@pytest.mark.parametrize("printed", [chr(0xD800), "a" + chr(0xDFFF) + "b", "\udcff\udcfe"])
def test_output_that_is_not_text_becomes_valid_text(printed):
    code = "print(1)"
    result = run([f"<code>{code}</code>\\boxed{{1}}"], sandbox=FakeSandbox({code: printed}))
    env = BPE.decode([t for t, m in zip(result.completion_ids[0], result.interpreter_mask[0]) if not m])
    assert env.startswith("<interpreter>") and env.endswith("</interpreter>")
    assert "\ufffd" in env
    env.encode("utf-8")  # strict: no lone surrogate left
    assert result.model_text == ["<code>print(1)</code>\\boxed{1}"]


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


TOKENIZER = make_char_tokenizer()


def rollout(scripts, sandbox=None, tokenizer=TOKENIZER, **spec):
    prompts = [tokenizer("Q:", add_special_tokens=False)["input_ids"] for _ in scripts]
    spec = RolloutSpec(max_completion_length=200, eos_token_ids=[tokenizer.eos_token_id], **spec)
    return interleaved_rollout(prompts, ScriptedBackend(tokenizer, scripts), sandbox or FakeSandbox(), tokenizer, spec)


def test_special_token_text_printed_by_code_stays_text():
    eos_text = TOKENIZER.eos_token
    result = rollout([f"<code>print('{eos_text}')</code>\\boxed{{1}}"])
    env_ids = [t for t, m in zip(result.completion_ids[0], result.interpreter_mask[0]) if not m]
    assert TOKENIZER.eos_token_id not in env_ids
    assert eos_text in TOKENIZER.decode(env_ids)


def test_tags_registered_as_special_tokens_still_hide_answers_in_code():
    tokenizer = make_char_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<code>", "</code>"]})
    script = "<code># the answer is \\boxed{42}\nprint(1)</code>done"
    result = rollout([script], tokenizer=tokenizer)
    assert result.model_text == [script]
    assert boxed_accuracy([""], ["42"], model_text=result.model_text) == [-1.0]
