"""`ReToolConfig`: TRL's `GRPOConfig` plus the fields of tool-integrated (code interpreter) rollouts."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from trl import GRPOConfig

from .format import SYSTEM_PROMPTS  # noqa: F401 - re-exported (earlier versions had it here)
from .format.prompts import SHIPPED_PROMPTS, Tags
from .format.registry import FORMAT_NAMES, resolve_system_prompt
from .options import SANDBOX_BACKENDS, TRUNCATION_SIDES, ReToolOptions
from .sandbox.cell_limits import ERROR_FORMATS


def _truncated_sampling(args, generation_kwargs: dict) -> str | None:
    """The settings that truncate sampling (`top_p < 1`, `top_k > 0`, `min_p > 0`, from the fields or from
    `generation_kwargs`, which vLLM reads last), as `name=value` text; `None` when sampling is not truncated."""
    values = {name: generation_kwargs.get(name, getattr(args, name, None)) for name in ("top_p", "top_k", "min_p")}
    truncating = {
        "top_p": values["top_p"] is not None and values["top_p"] < 1.0,
        "top_k": values["top_k"] is not None and values["top_k"] > 0,
        "min_p": values["min_p"] is not None and values["min_p"] > 0.0,
    }
    return ", ".join(f"{name}={values[name]}" for name, on in truncating.items() if on) or None


# vLLM sampling parameters that reshape the distribution its log-probs are taken from (`generation_kwargs`).
_RESHAPING_KWARGS = ("presence_penalty", "frequency_penalty", "logit_bias", "bad_words", "allowed_token_ids")


def _reshaped_sampling(args, generation_kwargs: dict) -> str | None:
    """The settings that change vLLM's sampling log-probs beyond the temperature (penalties, logit bias, banned or
    allowed tokens; TRL asks vLLM for processed log-probs, taken after them), as `name=value` text; `None` if none.
    The trainer's log-probs see the temperature only, so each token's ratio would carry the setting's factor."""
    values = {
        "repetition_penalty": generation_kwargs.get("repetition_penalty", getattr(args, "repetition_penalty", 1.0)),
        **{name: generation_kwargs.get(name) for name in _RESHAPING_KWARGS},
    }
    neutral = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    changed = [name for name, value in values.items() if value not in (None, neutral.get(name), {}, [])]
    return ", ".join(f"{name}={values[name]!r}" for name in changed) or None


def _replay_refusal(args, truncation: str, generation_kwargs: dict) -> str | None:
    """Why truncated sampling cannot get its kept sets replayed in this setting (one line), or `None`."""
    from .training.sampling_mask import refusal

    # Where the kept sets come from the top log-probs whatever the vLLM (`sampling_mask.replay_source_for`).
    tensor_parallel = args.vllm_tensor_parallel_size or 1
    logprobs_only = (
        "vllm_mode='server'"
        if args.vllm_mode == "server"
        else "rollout_mode='barrier'"
        if args.rollout_mode == "barrier"
        else f"vllm_tensor_parallel_size={tensor_parallel}"
        if tensor_parallel > 1
        else None
    )
    return refusal(truncation, generation_kwargs.get("top_k", args.top_k), logprobs_only)


def _bf16_supported() -> bool:
    """Whether transformers would accept `bf16=True` without `use_cpu` (a bf16 GPU, or an XLA device)."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    return is_torch_bf16_gpu_available() or is_torch_xla_available()


# `ReToolOptions` first among the bases so that its fields come after GRPOConfig's (dataclass fields follow the
# reversed MRO): positional arguments stay TrainingArguments' (`ReToolConfig("out")` is the output_dir).
@dataclass
class ReToolConfig(ReToolOptions, GRPOConfig):
    r"""
    Configuration for [`ReToolTrainer`]: every field of [`~trl.GRPOConfig`] (sampling, KL `beta`, clipping,
    `loss_type`, vLLM, logging, ...) plus the settings of the interleaved code-interpreter rollout.

    Text format (ReTool paper): the model writes `code_start` + Python + `code_end`; generation stops there, the code
    runs in a stateful sandbox session, and `interpreter_start` + output + `interpreter_end` is appended as
    environment tokens that are excluded from the loss. `max_completion_length` counts every completion token,
    interpreter tokens included.

    Parameters:
        > Text format

        call_format (`str`, defaults to `"tags"`):
            How the model calls the interpreter. `"tags"`: the inline tags below (the ReTool paper's format).
            `"tool_call"`: the chat template's own tool calls to a Python tool named `code_interpreter` (Qwen:
            `<tool_call>{"name": "code_interpreter", "arguments": {"code": ...}}</tool_call>`), each result returned
            as a `tool` message rendered by the template; needs a chat template TRL can parse (its shipped ones) that
            is prefix-preserving. `"markdown"`: a ```` ```python ```` block, answered by an ```` ```output ````
            fence. Whatever the format, the inserted ids are masked and the rewards read the model's own words.
        code_start (`str`, defaults to `"<code>"`):
            Tag that opens a code block written by the model.
        code_end (`str`, defaults to `"</code>"`):
            Tag that closes a code block; generation stops right after it and the block runs.
        interpreter_start (`str`, defaults to `"<interpreter>"`):
            Tag that opens the interpreter output the rollout inserts.
        interpreter_end (`str`, defaults to `"</interpreter>"`):
            Tag that closes the interpreter output.
        system_prompt (`str` or `None`, defaults to `"retool"`):
            Name of a shipped prompt (`retool`, `retool_concise`), a literal prompt, or `None`/`"none"`. It is
            prepended to conversational prompts that have no system message, as a system message; plain-text
            prompts are left as they are (a text prompt is the model's whole input, as in TRL). The tags above are
            filled in. A model saved by `ReToolTrainer` records it, and `retool-trl eval` of that model uses it.

        > Interpreter calls

        max_tool_calls (`int`, defaults to `8`):
            Executions allowed per completion. After that, `code_end` no longer stops generation or runs code.
            `0` gives text-only RL with the same trainer.
        max_interpreter_output_chars (`int`, defaults to `1024`):
            Interpreter output longer than this is cut (see `interpreter_truncation`) before it is tokenized.
        interpreter_truncation (`str`, defaults to `"middle"`):
            Which part of a long output survives: `"head"`, `"tail"` or `"middle"` (both ends kept).

        > Rollout

        rollout_mode (`str`, defaults to `"async"`):
            `"async"`: each completion runs its own generate -> execute -> continue loop, with vLLM (server or
            colocate mode). `"barrier"`: every turn waits for all sequences and snippets of the batch (always so with
            transformers generation, and with colocate `vllm_tensor_parallel_size` > 1).
        rollout_concurrency (`int`, defaults to `256`):
            Async rollout: completions in flight at once on each process.
        vllm_request_timeout_s (`float` or `None`, defaults to `None`):
            Async rollout in vLLM server mode: longest wait for one turn, in seconds (`None`: no limit). A turn past
            it ends its completion as an engine failure, counted in `retool/engine_timeout_ratio`; with
            `drop_infra_failures` on, that completion is unscored and out of the loss, without it the
            completion is scored as it stands.

        > Sandbox

        sandbox_backend (`str`, defaults to `"local"`):
            `"local"` (worker pool on this machine) or `"remote"` (SandboxFusion-compatible HTTP service).
        sandbox_workers (`int` or `None`, defaults to `None`):
            Size of the local worker pool (default: the CPUs this process may use, divided among the ranks on this
            node).
        sandbox_timeout_s (`float`, defaults to `5.0`):
            Wall-clock limit of one code execution, in seconds.
        sandbox_memory_mb (`int`, defaults to `1024`):
            Address-space limit of a sandbox session, in MiB (sent to the remote service as its memory limit).
        sandbox_url (`str`, `list[str]` or `None`, defaults to `None`):
            Base URL of the sandbox service (`retool-trl sandbox-server`, or SandboxFusion), or several (a list, or
            comma-separated): each session is pinned to one for its life. Required when `sandbox_backend="remote"`.
            The server's token (or this tenant's, where the server has per-tenant tokens) is read from
            `RETOOL_SANDBOX_TOKEN`.
        sandbox_max_concurrency (`int`, defaults to `32`):
            Requests in flight to the remote sandbox service.
        sandbox_memory_wait_s (`float`, defaults to `600`):
            On `retool-trl sandbox-server`, how long a session's open waits while the server's memory is reserved by
            other sessions (`429`, `memory_full`), as sessions close when their rollouts end; past it the session's
            calls fail as infrastructure errors (retried, never scored).

        > Rewards

        correct_reward (`float`, defaults to `1.0`):
            Reward of a correct final `\boxed{}` answer ([`~retool_trl.rewards.boxed_accuracy`]; ReTool: +1).
        incorrect_reward (`float`, defaults to `-1.0`):
            Reward of a wrong or missing final answer (ReTool: -1). Must be below `correct_reward`.
        tool_use_bonus (`float`, defaults to `0.0`):
            Shaping from the verl/slime ReTool recipes: a wrong answer that called code gets this much more than a
            wrong answer that did not ([`~retool_trl.rewards.tool_use_shaping`] is added). `0` disables it.

        > Stability (off by default, the paper's behaviour, except `drop_infra_failures`)

        filter_void_turns (`bool`, defaults to `False`):
            SimpleTIR: drop from the loss every completion with a "void" turn (a finished turn with neither a
            complete code block nor a `\boxed{}` answer).
        roc_oversample (`int`, defaults to `1`):
            rStar2-Agent's GRPO-RoC: sample `roc_oversample` x `num_generations` completions per prompt and keep
            `num_generations` (correct ones with the fewest tool errors and format problems, wrong ones at random).
            `1` disables it.
        dynamic_sampling (`bool`, defaults to `False`):
            DAPO's dynamic sampling: groups whose rewards all match (zero advantage) are dropped, and more prompts
            are rolled out until every process has a full generation batch or `dynamic_sampling_max_rounds` rounds
            have run. Metrics `retool/dynamic_sampling/{groups_dropped,rounds,zero_std_ratio,capped}`.
        dynamic_sampling_max_rounds (`int`, defaults to `3`):
            Most rollout rounds per generation batch, the first included. A step that reaches it trains on what it
            has (the kept groups, filled up with dropped ones) and logs `retool/dynamic_sampling/capped` = 1.
        dynamic_sampling_min_accuracy (`float` or `None`, defaults to `None`):
            With dynamic sampling, also drop groups whose share of correct answers is below this (SimpleTIR's
            band). Needs an `answer` column.
        dynamic_sampling_max_accuracy (`float` or `None`, defaults to `None`):
            With dynamic sampling, also drop groups whose share of correct answers is above this.
        drop_infra_failures (`bool`, defaults to `True`):
            A sandbox failure that is not the snippet's fault (worker lost, service down) is retried once; if it
            fails again, that completion is dropped from the loss and left unscored instead of scored as wrong.
    """

    def __post_init__(self):
        self._validate_retool_fields()
        self._check_json_fields()
        # TRL's default: `bf16` left unset is True (mixed precision), also with `use_cpu=True`, where transformers
        # accepts it (CPU autocast), so that a run without ReTool code trains exactly as `GRPOTrainer` would. Only
        # where transformers would refuse it (no bf16 GPU, no `use_cpu`) does it become False, so `ReToolConfig(...)`
        # works there as written (an explicit `bf16=True` still fails, as in TRL).
        if self.bf16 is None and not self.fp16 and not self.use_cpu and not _bf16_supported():
            self.bf16 = False
        # TRL's default `gradient_checkpointing=True` uses the name transformers >= 5.3 deprecates (one FutureWarning
        # per config); where `activation_checkpointing` exists and is unset, the value moves to it.
        if getattr(self, "activation_checkpointing", False) is None and self.gradient_checkpointing is not None:
            self.activation_checkpointing = self.gradient_checkpointing
        super().__post_init__()
        # After TrainingArguments has parsed the JSON form (`--generation_kwargs '{"num_beams": 4}'` on the command
        # line), so both forms are checked.
        self._validate_generation_kwargs()

    def _check_json_fields(self) -> None:
        # TrainingArguments parses these from JSON strings (the command-line form) and would raise a bare
        # JSONDecodeError that names no option.
        import json

        for name in self._VALID_DICT_FIELDS:
            value = getattr(self, name, None)
            if isinstance(value, str) and value.strip().startswith("{"):
                try:
                    json.loads(value)
                except ValueError as error:
                    raise ValueError(
                        f"ReToolConfig.{name} is not valid JSON ({error}): write it as an object with double-quoted "
                        f"keys, e.g. '{{\"top_k\": 20}}'."
                    ) from None

    def _validate_generation_kwargs(self) -> None:
        if self.generation_kwargs is not None and not isinstance(self.generation_kwargs, dict):
            raise ValueError(
                f"ReToolConfig.generation_kwargs must be a mapping (in YAML) or a JSON object (on the command line, "
                f"e.g. '{{\"top_k\": 20}}'), got {self.generation_kwargs!r}."
            )
        generation_kwargs = self.generation_kwargs or {}
        if generation_kwargs.get("num_beams", 1) != 1:
            raise ValueError(
                "ReToolConfig.generation_kwargs['num_beams'] must be 1: GRPO learns from completions sampled from the "
                "policy, and beam search is a search, not a sample (its completions and their log-probabilities are "
                "not the policy's). Remove num_beams; use num_generations for more samples per prompt."
            )
        if generation_kwargs.get("min_tokens"):
            raise ValueError(
                "ReToolConfig.generation_kwargs['min_tokens'] is not supported: vLLM applies it to each request, and "
                "the rollout makes one request per turn, so every turn (each code call's continuation too) would be "
                "forced to that length, not the completion. Remove min_tokens."
            )
        truncation = _truncated_sampling(self, generation_kwargs)
        if truncation and self.use_vllm and self.vllm_importance_sampling_correction:
            # vLLM's log-probs are renormalised over the tokens the truncation keeps, the trainer's are over the
            # whole vocabulary: the trainer replays each token's kept set (`training.sampling_mask`) so the weights
            # correct rather than scale by the kept mass. Refused where the kept sets cannot be had.
            problem = _replay_refusal(self, truncation, generation_kwargs)
            if problem:
                raise ValueError(problem)
        reshaped = _reshaped_sampling(self, generation_kwargs)
        if reshaped and self.use_vllm and self.vllm_importance_sampling_correction:
            raise ValueError(
                f"ReToolConfig: {reshaped} with vllm_importance_sampling_correction biases the correction (vLLM's "
                "log-probs are taken after the penalty or bias, the trainer's are not, so every weight carries its "
                "factor); remove it or set vllm_importance_sampling_correction=False."
            )
        if generation_kwargs.get("num_return_sequences", 1) != 1:
            raise ValueError(
                "ReToolConfig.generation_kwargs['num_return_sequences'] must be 1: the rollout continues each "
                "completion after its code runs, one sequence per completion. Use num_generations for more samples "
                "per prompt."
            )

    def _validate_retool_fields(self) -> None:
        # Checked first, so the missing extra is named before anything else is set up or loaded.
        if self.use_vllm and importlib.util.find_spec("vllm") is None:
            raise ValueError(
                "use_vllm=True but vLLM is not installed: install the extra with `pip install 'retool-trl[vllm]'` "
                "or set use_vllm=False."
            )
        if self.call_format not in FORMAT_NAMES:
            raise ValueError(
                f"ReToolConfig.call_format must be one of {', '.join(FORMAT_NAMES)}, got {self.call_format!r}."
            )
        tags = {
            "code_start": self.code_start,
            "code_end": self.code_end,
            "interpreter_start": self.interpreter_start,
            "interpreter_end": self.interpreter_end,
        }
        for name, tag in tags.items():
            if not isinstance(tag, str) or len(tag.strip()) < 2:
                # One character cannot be defanged in interpreter output (see `parsing.clean_output`).
                raise ValueError(f"ReToolConfig.{name} must be a tag of at least 2 characters, got {tag!r}.")
        if len(set(tags.values())) != len(tags):
            raise ValueError(f"ReToolConfig tags must be distinct, got {tags}.")
        for name, tag in tags.items():
            for other_name, other in tags.items():
                if name != other_name and other.startswith(tag):
                    raise ValueError(
                        f"ReToolConfig.{name} {tag!r} is a prefix of {other_name} {other!r}: the blocks could not be "
                        "told apart; choose tags where none starts another."
                    )
        if self.max_tool_calls < 0:
            raise ValueError(f"ReToolConfig.max_tool_calls must be >= 0, got {self.max_tool_calls}.")
        if self.max_interpreter_output_chars < 16:
            raise ValueError(
                "ReToolConfig.max_interpreter_output_chars must be >= 16 (room for the truncation marker), got "
                f"{self.max_interpreter_output_chars}."
            )
        if self.interpreter_truncation not in TRUNCATION_SIDES:
            raise ValueError(
                f"ReToolConfig.interpreter_truncation must be one of {TRUNCATION_SIDES}, got "
                f"{self.interpreter_truncation!r}."
            )
        if self.interpreter_errors not in ERROR_FORMATS:
            raise ValueError(
                f"ReToolConfig.interpreter_errors must be one of {ERROR_FORMATS}, got {self.interpreter_errors!r}."
            )
        if self.max_cell_chars is not None and self.max_cell_chars < 1:
            raise ValueError(f"ReToolConfig.max_cell_chars must be >= 1 or None, got {self.max_cell_chars}.")
        if self.rollout_mode not in ("async", "barrier"):
            raise ValueError(f"ReToolConfig.rollout_mode must be 'async' or 'barrier', got {self.rollout_mode!r}.")
        if self.rollout_concurrency < 1:
            raise ValueError(f"ReToolConfig.rollout_concurrency must be >= 1, got {self.rollout_concurrency}.")
        if self.vllm_request_timeout_s is not None and self.vllm_request_timeout_s <= 0:
            raise ValueError(
                "ReToolConfig.vllm_request_timeout_s must be > 0 or None (no limit), got "
                f"{self.vllm_request_timeout_s}."
            )
        if self.sandbox_backend not in SANDBOX_BACKENDS:
            raise ValueError(
                f"ReToolConfig.sandbox_backend must be one of {SANDBOX_BACKENDS}, got {self.sandbox_backend!r}."
            )
        if self.sandbox_backend == "remote" and not self.sandbox_url:
            raise ValueError("ReToolConfig.sandbox_url is required when sandbox_backend='remote'.")
        if not self.sandbox_memory_wait_s >= 0:  # NaN too
            raise ValueError(f"ReToolConfig.sandbox_memory_wait_s must be >= 0, got {self.sandbox_memory_wait_s}.")
        if self.sandbox_timeout_s <= 0:
            raise ValueError(f"ReToolConfig.sandbox_timeout_s must be > 0, got {self.sandbox_timeout_s}.")
        if self.sandbox_memory_mb < 64:
            raise ValueError(f"ReToolConfig.sandbox_memory_mb must be >= 64, got {self.sandbox_memory_mb}.")
        if self.sandbox_workers is not None and self.sandbox_workers < 1:
            raise ValueError(f"ReToolConfig.sandbox_workers must be >= 1 or None, got {self.sandbox_workers}.")
        if self.correct_reward <= self.incorrect_reward:
            raise ValueError(
                f"ReToolConfig.correct_reward ({self.correct_reward}) must be greater than incorrect_reward "
                f"({self.incorrect_reward})."
            )
        if self.roc_oversample < 1:
            raise ValueError(f"ReToolConfig.roc_oversample must be >= 1, got {self.roc_oversample}.")
        self._validate_dynamic_sampling()
        if not 0.0 <= self.tool_use_bonus < (self.correct_reward - self.incorrect_reward) / 2:
            raise ValueError(
                f"ReToolConfig.tool_use_bonus must be in [0, (correct_reward - incorrect_reward) / 2), got "
                f"{self.tool_use_bonus}: a wrong answer must never score close to a right one."
            )
        if self.max_completion_length is None or self.max_completion_length < 1:
            raise ValueError(
                "ReToolConfig.max_completion_length must be >= 1 (it bounds every completion, interpreter tokens "
                f"included), got {self.max_completion_length}."
            )
        prompt = self.system_prompt
        if prompt is not None and prompt.strip().lower() != "none" and prompt not in SHIPPED_PROMPTS:
            if prompt.isidentifier():  # a name, not a prompt: most likely a typo of a shipped one
                raise ValueError(
                    f"ReToolConfig.system_prompt={prompt!r} is not a shipped prompt ({', '.join(SHIPPED_PROMPTS)}); "
                    "give one of those names, 'none', or the prompt text itself."
                )

    def _validate_dynamic_sampling(self) -> None:
        rounds = self.dynamic_sampling_max_rounds
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise ValueError(f"ReToolConfig.dynamic_sampling_max_rounds must be an integer >= 1, got {rounds!r}.")
        band = {"min": self.dynamic_sampling_min_accuracy, "max": self.dynamic_sampling_max_accuracy}
        for side, value in band.items():
            if value is not None and (isinstance(value, bool) or not 0.0 <= value <= 1.0):
                raise ValueError(
                    f"ReToolConfig.dynamic_sampling_{side}_accuracy must be a share of correct answers in [0, 1] or "
                    f"None, got {value!r}."
                )
        if None not in band.values() and band["min"] > band["max"]:
            raise ValueError(
                f"ReToolConfig.dynamic_sampling_min_accuracy ({band['min']}) must not be above "
                f"dynamic_sampling_max_accuracy ({band['max']}): no group could be kept."
            )
        if not self.dynamic_sampling and any(value is not None for value in band.values()):
            raise ValueError(
                "ReToolConfig.dynamic_sampling_min_accuracy / dynamic_sampling_max_accuracy act only with "
                "dynamic_sampling=True: set it, or unset the band."
            )

    @property
    def resolved_system_prompt(self) -> str | None:
        """The system prompt text with the configured tags filled in, or `None`."""
        return resolve_system_prompt(self.system_prompt, Tags.from_config(self), self.call_format)
