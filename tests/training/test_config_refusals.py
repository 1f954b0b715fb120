"""Settings the trainer cannot honour are refused when the run is built, each with one line that says what prevents
it."""

from __future__ import annotations

import pytest
from datasets import Dataset

from helpers.testing_utils import trainer_for
from retool_trl import ReToolConfig


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
    "tags,problem",
    [(dict(code_end="»"), "at least 2 characters"), (dict(interpreter_start="<code>x"), "is a prefix of")],
)
def test_tags_that_cannot_be_told_apart_are_refused(tmp_path, tags, problem):
    with pytest.raises(ValueError, match=problem):
        ReToolConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **tags)


def test_min_tokens_is_refused_with_one_clear_line(tmp_path):
    """vLLM applies `min_tokens` to each request, i.e. each turn, not to the completion: refused, saying why."""
    with pytest.raises(ValueError, match=r"min_tokens.*each request") as error:
        ReToolConfig(output_dir=str(tmp_path), generation_kwargs={"min_tokens": 8}, report_to="none", use_cpu=True)
    assert "\n" not in str(error.value)


def test_config_rejects_beams_typo_prompts_and_unbounded_length(tmp_path):
    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="num_beams"):
        ReToolConfig(**base, generation_kwargs={"num_beams": 2})
    with pytest.raises(ValueError, match="system_prompt"):
        ReToolConfig(**base, system_prompt="retool_consise")
    with pytest.raises(ValueError, match="max_completion_length"):
        ReToolConfig(**base, max_completion_length=None)
    assert ReToolConfig(**base, system_prompt="Think, then use code.").resolved_system_prompt.startswith("Think")
