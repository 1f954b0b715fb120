"""Pins the TRL internals ReToolTrainer relies on, so a TRL upgrade that changes them fails here, loudly."""

import inspect
import re

import trl
from datasets import Dataset
from packaging.version import Version
from trl import GRPOConfig, GRPOTrainer

from helpers.testing_utils import save_tiny_model


def test_trl_version_is_in_the_tested_range():
    assert Version("1.16") <= Version(trl.__version__) < Version("1.17")


def test_rollout_func_seam_and_generate_return_shape(tmp_path, char_tokenizer):
    completions = [[5, 6, 7, char_tokenizer.eos_token_id], [8, 9, char_tokenizer.eos_token_id]]
    env_masks = [[1, 0, 1, 1], [1, 1, 1]]
    calls = []

    def rollout(prompts, trainer):
        calls.append(prompts)
        return {
            "prompt_ids": char_tokenizer(prompts)["input_ids"],
            "completion_ids": completions,
            "logprobs": None,
            "env_mask": env_masks,
            "my_fact": [3, 4],
        }

    trainer = GRPOTrainer(
        save_tiny_model(tmp_path / "m", char_tokenizer),
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=GRPOConfig(
            output_dir=str(tmp_path),
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=8,
            report_to="none",
            bf16=False,
            use_cpu=True,
        ),
        train_dataset=Dataset.from_list([{"prompt": "a"}, {"prompt": "a"}]),
        processing_class=char_tokenizer,
        rollout_func=rollout,
    )
    trainer.model.train()
    # `_generate(prompts)` returns an 8-tuple whose third item is the env_mask, used as TRL's tool_mask.
    out = trainer._generate(["a", "a"])
    assert len(out) == 8 and calls == [["a", "a"]]
    prompt_ids, completion_ids, tool_mask, _, logprobs, extra_fields, _, _ = out
    assert completion_ids == completions and tool_mask == env_masks and logprobs is None
    assert extra_fields == {"my_fact": [3, 4]}
    # Model-token lengths (tool_mask == 1) are what TRL logs as completion lengths.
    assert trainer._metrics["train"]["completions/mean_length"][-1] == 3.0

    # `_generate_and_score_completions` passes the mask on as `tool_mask` (padded) for `_compute_loss`.
    inputs = trainer._generate_and_score_completions([{"prompt": "a"}, {"prompt": "a"}])
    assert inputs["tool_mask"].tolist() == [[1, 0, 1, 1], [1, 1, 1, 1]]
    assert "tool_mask" in inspect.getsource(GRPOTrainer._compute_loss)


def test_private_members_used_by_the_trainer_exist():
    for name in ("_tokenize_prompts", "_generate", "_generate_and_score_completions", "_calculate_rewards"):
        assert callable(getattr(GRPOTrainer, name)), name
    assert list(inspect.signature(GRPOTrainer._tokenize_prompts).parameters) == ["self", "prompts"]
    assert list(inspect.signature(GRPOTrainer._calculate_rewards).parameters) == [
        "self",
        "inputs",
        "prompts",
        "completions",
        "completion_ids_list",
    ]
    source = inspect.getsource(GRPOTrainer.__init__)
    for attribute in ("self.generation_config", "self.generation_kwargs", "self.eos_token_ids", "self._dist"):
        assert attribute in source, attribute
    assert "summon_full_params" in inspect.getsource(GRPOTrainer._generate_single_turn)
    # The tool-call format inserts what TRL's own tool loop inserts for a tool message, through this helper, called
    # on a stand-in that carries only the attributes read here (a TRL that reads more breaks the format loudly).
    assert list(inspect.signature(GRPOTrainer._get_tool_suffix_ids).parameters) == ["self", "tool_messages"]
    suffix_source = inspect.getsource(GRPOTrainer._get_tool_suffix_ids)
    read = set(re.findall(r"self\.(\w+)", suffix_source))
    assert read <= {"processing_class", "_tokenizer", "_is_vlm", "chat_template", "chat_template_kwargs"}, read
    # The stage timings wrap these methods of TRL's and call them unchanged.
    for name in ("training_step", "_prepare_inputs", "_get_per_token_logps_and_entropies"):
        assert callable(getattr(GRPOTrainer, name)), name


def test_vllm_generation_state_the_backends_read():
    """`VLLMBackend` and the async rollout read (and, for sleep mode, set) these members of TRL's private helper."""
    from trl.generation.vllm_generation import VLLMGeneration

    parameters = list(inspect.signature(VLLMGeneration.generate).parameters)
    assert parameters[:5] == ["self", "prompts", "images", "num_generations", "profiler"]
    source = inspect.getsource(VLLMGeneration)
    used = [
        # the barrier backend: per-call budget, stop strings, collective mode, sleep-mode handling
        "mode",
        "tensor_parallel_size",
        "max_completion_length",
        "generation_kwargs",
        "enable_sleep_mode",
        "_llm_weights_sleeping",
        "llm",
        # the async rollout: TRL's server-mode sampling settings, sent with each request
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "structured_outputs_regex",
    ]
    missing = [name for name in used if f"self.{name} =" not in source]
    assert not missing, f"VLLMGeneration no longer sets {missing}"
    assert callable(VLLMGeneration.sync_weights)


def test_the_is_ratio_the_sampling_mask_replay_feeds():
    """The replay (`training.sampling_mask`) lifts the rollout's sampling log-probs by the trainer's kept mass, and
    reads the scored batch for `retool/is/*`: TRL must compute its vLLM ratio as exp(old - sampling) from the
    rollout's log-probs, keep both tensors in the batch, and build its colocated `LLM` through the name the replay
    wraps to ask for the kept sets."""
    import trl.generation.vllm_generation as helper_module

    source = inspect.getsource(GRPOTrainer._generate_and_score_completions)
    assert "old_per_token_logps - sampling_per_token_logps" in source
    assert 'output["old_per_token_logps"]' in source and 'output["sampling_per_token_logps"]' in source
    helper_source = inspect.getsource(helper_module)  # `LLM` is a module global there (imported where vLLM is)
    assert "self.llm = LLM(" in helper_source and re.search(r"^\s+from vllm import .*\bLLM\b", helper_source, re.M)
