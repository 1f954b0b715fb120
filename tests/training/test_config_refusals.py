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


# ------------------------------------------------------------------ importance sampling under truncated sampling
def vllm_config(tmp_path, monkeypatch, **overrides):
    """A `ReToolConfig` with `use_vllm=True`, as where vLLM is installed (this suite runs without it)."""
    import importlib.util

    from retool_trl import ReToolConfig

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else find_spec(name, *a)
    )
    settings = dict(output_dir=str(tmp_path), use_vllm=True, report_to="none", use_cpu=True)
    return ReToolConfig(**{**settings, **overrides})


@pytest.mark.parametrize(
    "sampling",
    [{"top_p": 0.95}, {"top_k": 20}, {"min_p": 0.05}, {"generation_kwargs": {"top_p": 0.9}}],
    ids=["top_p", "top_k", "min_p", "generation_kwargs"],
)
def test_truncated_sampling_with_vllm_importance_sampling_is_refused_in_one_line(tmp_path, monkeypatch, sampling):
    """`top_p < 1`, `top_k > 0` or `min_p > 0` sampling on vLLM with TRL 1.16's importance-sampling correction (on by
    default): vLLM's log-probs are renormalised over the kept tokens (`processed_logprobs`), the trainer's are not,
    so each weight is the kept mass, not a correction (checked on a real distribution below). Before, the run
    trained with biased weights; now the combination is refused in one line that names both fixes."""
    with pytest.raises(ValueError) as error:
        vllm_config(tmp_path, monkeypatch, **sampling)
    message = str(error.value)
    assert "\n" not in message and "vllm_importance_sampling_correction=False" in message and "top_p=1.0" in message
    name = next(iter(sampling if "generation_kwargs" not in sampling else sampling["generation_kwargs"]))
    assert f"{name}=" in message
    # Either fix is accepted; so is truncation without vLLM (no importance weights at all).
    vllm_config(tmp_path, monkeypatch, vllm_importance_sampling_correction=False, **sampling)
    vllm_config(tmp_path, monkeypatch)


def test_config_rejects_beams_typo_prompts_and_unbounded_length(tmp_path):
    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    with pytest.raises(ValueError, match="num_beams"):
        ReToolConfig(**base, generation_kwargs={"num_beams": 2})
    with pytest.raises(ValueError, match="system_prompt"):
        ReToolConfig(**base, system_prompt="retool_consise")
    with pytest.raises(ValueError, match="max_completion_length"):
        ReToolConfig(**base, max_completion_length=None)
    assert ReToolConfig(**base, system_prompt="Think, then use code.").resolved_system_prompt.startswith("Think")
