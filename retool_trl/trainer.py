"""`ReToolTrainer`: TRL's `GRPOTrainer` with an interleaved code-interpreter rollout.

Only the rollout changes. It is plugged into TRL through the `rollout_func` seam of `GRPOTrainer._generate`, which
returns `prompt_ids`, `completion_ids`, `logprobs` and an `env_mask` that TRL uses as its `tool_mask`. We chose that
seam over overriding `_generate` because TRL's `_generate` then still does everything else itself (decoding,
length/clipping metrics counted on model tokens only, vLLM weight sync, passing our per-sample facts to reward
functions), so nothing of it is copied here. Everything after the rollout (reference model, KL, clipping, loss types,
PEFT, importance sampling, logging) is TRL's and multiplies by `tool_mask`, so interpreter tokens never reach the loss.
Where a step's time goes is timed around TRL's own methods, which are called unchanged (`training.stage_timings`).
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
import warnings

import torch
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context
from trl.models import unwrap_model_for_generation

from .config import ReToolConfig
from .data.prompt_ids import tokenize_prompts
from .format.parsing import with_system_prompt
from .format.prompts import write_prompt_settings
from .format.registry import format_of
from .models.names import resolve_model
from .models.tokenizers import declares_generic_tokenizer, load_tokenizer
from .rewards.functions import bind_config, boxed_accuracy, is_correct
from .rollout.batched import RolloutResult, RolloutSpec, interleaved_rollout
from .rollout.engines.transformers_generate import TransformersBackend
from .rollout.engines.vllm_batched import VLLMBackend, use_reload_weights_on_cpu
from .rollout.engines.vllm_colocate import ColocateEngine
from .rollout.engines.vllm_server import async_applies, served_max_model_len, server_engine_from_config, server_url
from .rollout.per_completion import async_rollout
from .sandbox.factory import sandbox_from_config, with_cell_limits
from .training.dynamic_sampling import dynamic_sampler
from .training.inputs import check_answer_column, check_chat_template, with_shaping
from .training.metrics import rollout_metrics
from .training.sampling_mask import engine_options, lift_to_kept_mass, log_is_outside, replay_for, replay_source_for
from .training.sandbox_health import SandboxHealth
from .training.stability import dropped_from_loss, resample_on_correct, select_rows
from .training.stage_timings import StageTimings

logger = logging.getLogger(__name__)


class ReToolTrainer(StageTimings, GRPOTrainer):
    """GRPO with a Python interpreter in the loop (ReTool, arXiv 2504.11536).

    Takes the arguments of [`~trl.GRPOTrainer`]; `args` must be a [`ReToolConfig`]. With `reward_funcs=None` the
    reward is [`~retool_trl.rewards.boxed_accuracy`] (math-verify on the model's final `\\boxed{}`), which needs an
    `answer` column in the dataset.

    Args:
        sandbox (*optional*):
            A `retool_trl.sandbox` backend to run code in. By default one is built from `args` (`sandbox_backend`,
            `sandbox_workers`, `sandbox_timeout_s`, ...) at the first rollout and closed when `train()` returns.
    """

    _tag_names = ["trl", "grpo", "retool"]

    def __init__(self, model, reward_funcs=None, args: ReToolConfig | None = None, *pos, sandbox=None, **kwargs):
        if isinstance(model, str):  # a shipped alias ("quickstart") becomes its folder; impossible names fail now
            model = resolve_model(model, "model")
            if len(pos) < 3 and kwargs.get("processing_class") is None and declares_generic_tokenizer(model):
                # TRL's AutoProcessor would swap in the model type's tokenizer class (see `load_tokenizer`).
                trust = bool(args is not None and args.trust_remote_code)
                kwargs["processing_class"] = load_tokenizer(model, trust_remote_code=trust)
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = ReToolConfig(f"{name.split('/')[-1]}-ReTool")
        if not isinstance(args, ReToolConfig):
            raise TypeError(f"ReToolTrainer needs `args` to be a ReToolConfig, got {type(args).__name__}.")
        for conflicting in ("rollout_func", "tools", "environment_factory"):
            if kwargs.get(conflicting) is not None:
                raise ValueError(
                    f"ReToolTrainer runs its own code-interpreter rollout; `{conflicting}` is not supported."
                )
        reward_funcs = with_shaping(reward_funcs if reward_funcs is not None else [boxed_accuracy], args)
        datasets = [kwargs.get("train_dataset"), kwargs.get("eval_dataset"), *pos[:2]]  # by keyword or position
        check_answer_column(reward_funcs, *datasets)
        reward_funcs = [bind_config(func, args) for func in reward_funcs]
        # Truncated sampling with the IS correction: the engine is built to report each token's kept set.
        with engine_options(replay_source_for(args)) as built:
            super().__init__(model, reward_funcs, args, *pos, **kwargs)
        self._replay = None
        if built["source"]:
            self._replay = replay_for(args, self.vllm_generation, len(self._tokenizer), built["source"])
        check_chat_template(self.processing_class, datasets, model)
        # Built now: a chat template that cannot carry the tool calls is refused before any step runs.
        self._call_format = format_of(args).from_config(args, self._tokenizer)
        # Set after __init__: TRL's constructor warns that `rollout_func` is experimental; the seam is pinned by
        # tests/training/test_trl_contract.py instead.
        self.rollout_func = self._retool_rollout
        if self.use_vllm:  # vLLM's CPU build needs its own reload API for the weight sync; elsewhere TRL's stays
            use_reload_weights_on_cpu(self.vllm_generation)
        self._sandbox = sandbox
        self._owns_sandbox = sandbox is None
        self._sandbox_health = SandboxHealth("training")  # stops the run when the sandbox cannot run code
        self._rollout_inputs: list[dict] = []
        self._dropped: list[bool] = []
        self._roc_rng = random.Random(args.seed)
        self._dynamic_sampling = dynamic_sampler(self)
        self._round_rewards: torch.Tensor | None = None  # the last scoring's rewards over all processes
        self._round_correct: list[bool] = []  # ...and, for the accuracy band, this process's correct answers

    # ----------------------------------------------------------------------------------------------- sandbox
    @property
    def sandbox(self):
        if self._sandbox is None:
            self._sandbox = sandbox_from_config(self.args)
        # A sandbox given by the user gets the config's cell limits too (a no-op when set already or not asked for).
        self._sandbox = with_cell_limits(self._sandbox, self.args)
        return self._sandbox_health.watch(self.timed_sandbox(self._sandbox))  # timed, then counted

    def close_sandbox(self) -> None:
        """Stops the sandbox workers this trainer started (a user-provided sandbox is left to its owner)."""
        if self._sandbox is not None and self._owns_sandbox:
            self._sandbox.close()
            self._sandbox = None

    def train(self, *args, **kwargs):
        self._training = True
        try:
            return super().train(*args, **kwargs)
        finally:
            self._training = False
            self.close_sandbox()

    def evaluate(self, *args, **kwargs):
        """TRL's evaluation; a sandbox it had to build (called outside `train`) is closed when it returns or fails."""
        built_here = self._sandbox is None and not getattr(self, "_training", False)
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            if built_here:
                self.close_sandbox()

    # ----------------------------------------------------------------------------------------------- rollout
    def _with_system_prompt(self, prompts: list) -> list:
        return with_system_prompt(prompts, self.args.resolved_system_prompt)

    def _generate_rollout(self, prompt_ids: list[list[int]]) -> RolloutResult:
        """Runs the interleaved rollout with vLLM (`use_vllm`) or transformers `generate`."""
        spec = RolloutSpec.from_config(
            self.args, self.eos_token_ids, self._engine_max_model_len(), call_format=self._call_format
        )
        if self.use_vllm and self.args.rollout_mode == "async" and async_applies(self.vllm_generation):
            if self.vllm_generation.mode == "server" and self.accelerator.num_processes > 1:
                # As TRL's own server path (its `gather_object` of the prompts): no process sends a request before
                # the main process has pushed the new weights and reset the server's prefix cache (`sync_weights`).
                self.accelerator.wait_for_everyone()
            # Each completion its own loop against the continuously batching engine (the server, or this process's
            # colocated engine driven request by request); no collective call is needed. Weights were synced by TRL.
            with profiling_context(self, "vLLM.async_rollout"):
                return async_rollout(
                    prompt_ids,
                    self.timed_engine(self._make_async_engine()),
                    self.sandbox,
                    self._tokenizer,
                    spec,
                    self.args.rollout_concurrency,
                )
        if self.use_vllm:  # TRL's `_generate` already synced the weights before calling the rollout
            backend = VLLMBackend(
                self.vllm_generation,
                self._tokenizer,
                self._call_format.stop,
                accelerator=self.accelerator,
                profiler=lambda: profiling_context(self, "vLLM.generate"),
                max_model_len=spec.max_model_len,
                replay=self._replay,
            )
            return interleaved_rollout(prompt_ids, backend, self.sandbox, self._tokenizer, spec)
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                generation_kwargs=self.generation_kwargs,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            backend = self._make_generation_backend(unwrapped_model)
            return interleaved_rollout(prompt_ids, backend, self.sandbox, self._tokenizer, spec)

    def _make_async_engine(self):
        """The per-completion turn engine of the async rollout: the vLLM server's completions endpoint, or the
        colocated engine's request-level API."""
        if self.vllm_generation.mode == "colocate":
            return ColocateEngine(self.vllm_generation, self._tokenizer, self._call_format.stop, replay=self._replay)
        return server_engine_from_config(
            self.args,
            self._tokenizer,
            self.vllm_generation,
            server_url(self.args),
            self._engine_max_model_len(),
            replay=self._replay,
        )

    def _engine_max_model_len(self) -> int | None:
        """The vLLM engine's context limit (prompt + completion tokens): the colocated engine's own, or the server's
        (its `/v1/models` card); `None` without vLLM or when the server's card does not say.

        A server that fails to answer (an HTTP error, a timeout) is asked again, a few times now and at the next
        rollout: a failed answer is never kept as "no limit", which would turn the context protection off for the
        whole run (and the first full context would stop it with HTTP 400)."""
        if not self.use_vllm:
            return None
        if getattr(self, "_max_model_len", 0) != 0:  # known (a card without the field is known as `None`)
            return self._max_model_len
        if self.vllm_generation.mode == "colocate":
            limit = None
            with contextlib.suppress(AttributeError):
                limit = self.vllm_generation.llm.llm_engine.model_config.max_model_len
            self._max_model_len = limit or self.args.vllm_max_model_length
            return self._max_model_len
        url, problem = f"{server_url(self.args)}/v1/models", None
        for attempt in range(3):
            problem = served_max_model_len(url)
            if not isinstance(problem, str):
                self._max_model_len = problem
                if problem is None:
                    logger.warning(
                        "the vLLM server's model card (%s) has no max_model_len: turns are not fitted to its context",
                        url,
                    )
                return problem
            time.sleep(0.5 * 2**attempt)
        logger.warning(
            "could not read the vLLM server's context limit (%s): %s; asking again next rollout", url, problem
        )
        return None

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        super().save_model(output_dir, _internal_call)
        if self.is_world_process_zero():  # how prompts were built, for `retool-trl eval` of this model
            write_prompt_settings(output_dir or self.args.output_dir, self.args, self.train_dataset)

    def _make_generation_backend(self, unwrapped_model):
        """The turn generator of the rollout (tests substitute a scripted one here)."""
        return TransformersBackend(
            unwrapped_model, self._tokenizer, self.generation_config, self._call_format.stop, self.eos_token_ids
        )

    def _generate(self, prompts):
        # Thin wrapper. Where the tokenizer has a response schema, TRL reads each conversational completion as ONE
        # assistant message (`parse_response`), which keeps only the last turn of a multi-turn completion: rewards
        # reading `completions` would miss an answer written before a tool call. Every completion reaches the reward
        # functions whole, each turn and the interpreter's answers included, decoded as TRL decodes it without one.
        output = super()._generate(prompts)
        if prompts and isinstance(prompts[0], list):
            texts = self.processing_class.batch_decode(output[1], skip_special_tokens=True)
            output = (*output[:3], [[{"role": "assistant", "content": text}] for text in texts], *output[4:])
        return output

    def _generate_and_score_completions(self, inputs):
        if self._dynamic_sampling is not None and self.model.training:
            # Drops groups with nothing to learn and scores more prompts in their place (`training.dynamic_sampling`).
            return self._dynamic_sampling.fill(inputs, self._score_completions)
        return self._score_completions(inputs)

    def _score_completions(self, inputs):
        # Thin wrapper: the rollout needs the dataset rows (answers) for GRPO-RoC; TRL only passes it the prompts.
        self._rollout_inputs = inputs
        with _checkpointing_alias_quiet():
            output = super()._generate_and_score_completions(inputs)
        # Rows dropped from the loss (void turns, infrastructure failures) leave it here, after TRL has logged their
        # real lengths: an all-zero env_mask would have been logged as an empty completion.
        if any(self._dropped):
            output["tool_mask"][torch.tensor(self._dropped, device=output["tool_mask"].device)] = 0
        # ...and out of the loss normaliser TRL computed from the same masks (dapo/cispo/vespo divide by it). A
        # collective call, so every process makes it, dropped rows or not; unchanged when nothing was dropped.
        if "tool_mask" in output:
            kept = (output["completion_mask"] * output["tool_mask"]).sum()
            output["num_items_in_batch"] = self.accelerator.gather(kept).sum()
        if self.use_vllm and self.args.vllm_importance_sampling_correction:
            log_is_outside(self, output)
        return output

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self.args.drop_infra_failures:
            # Unscored by every reward function, not only boxed_accuracy: TRL then gives them zero advantage and
            # leaves them out of the group baseline. Rewards are gathered over processes, so is the flag.
            failed = torch.tensor([bool(x.get("infra_failed")) for x in inputs], device=rewards.device)
            rewards[self.accelerator.gather(failed)] = torch.nan
        self._round_rewards = rewards
        return rewards

    def _retool_rollout(self, prompts: list, trainer=None) -> dict:
        """TRL `rollout_func`: prompts in, token ids + interpreter mask (`env_mask`) + reward kwargs out."""
        args = self.args
        prompts = self._with_system_prompt(prompts)
        if self._call_format.tools:  # the tool's schema in the prompt, as evaluation renders it
            prompt_ids = tokenize_prompts(self.processing_class, prompts, self.args)
        else:
            prompt_ids, _, _ = self._tokenize_prompts(prompts)
            prompt_ids = [list(ids) for ids in prompt_ids]
        mode = "train" if self.model.training else "eval"
        self._sandbox_health.what = "training" if mode == "train" else "evaluation"  # what stops, in its message
        with self._sandbox_health.step(self.sandbox, args.max_tool_calls > 0, self.accelerator):
            if args.roc_oversample > 1 and mode == "train":
                result = self._resample_on_correct(prompts, prompt_ids)
            else:
                result = self._generate_rollout(prompt_ids)

        dropped = dropped_from_loss(result, args.filter_void_turns, args.drop_infra_failures)
        self._dropped = list(dropped)
        if self._dynamic_sampling is not None and self._dynamic_sampling.uses_band and mode == "train":
            pairs = zip(self._rollout_inputs, result.model_text, strict=True)
            self._round_correct = [is_correct(None, row["answer"], text, self._call_format) for row, text in pairs]
        metrics = rollout_metrics(result, self.accelerator.gather, self.accelerator.device)
        metrics["retool/dropped_from_loss_ratio"] = (
            self.accelerator.gather(torch.tensor(dropped, dtype=torch.float32, device=self.accelerator.device))
            .mean()
            .item()
        )
        # Turns that outlasted the user's request timeout, apart from the other engine failures.
        metrics["retool/engine_timeout_ratio"] = (
            self.accelerator.gather(
                torch.tensor(
                    [n > 0 for n in result.num_engine_timeouts], dtype=torch.float32, device=self.accelerator.device
                )
            )
            .mean()
            .item()
        )
        for name, value in metrics.items():
            self._metrics[mode][name].append(value)

        logprobs = result.logprobs
        if self._replay is not None and logprobs is not None:  # the kept mass goes into the IS ratio's input only
            with profiling_context(self, "sampling_mask.kept_mass"):
                logprobs = lift_to_kept_mass(self, prompt_ids, result)
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": result.completion_ids,
            "logprobs": logprobs,
            "env_mask": result.interpreter_mask,
            # Per-completion facts only: TRL hands them to every reward function as kwargs (and writes them into the
            # batch rows). Settings of the built-in rewards are bound from the config instead (`bind_config`).
            **result.extra_fields(),
        }

    def _resample_on_correct(self, prompts: list, prompt_ids: list[list[int]]) -> RolloutResult:
        """GRPO-RoC: roll out `roc_oversample` x each group, keep `num_generations` per group (see `stability`)."""
        group, factor = self.num_generations, self.args.roc_oversample
        inputs = self._rollout_inputs
        if len(prompts) % group or any(
            prompts[g] != prompts[g + i] for g in range(0, len(prompts), group) for i in range(group)
        ):
            raise ValueError(
                "ReToolConfig.roc_oversample > 1 needs whole groups of num_generations on each process; make the "
                "per-process generation batch a multiple of num_generations (or set roc_oversample=1)."
            )
        if len(inputs) != len(prompts) or "answer" not in inputs[0]:
            raise ValueError("ReToolConfig.roc_oversample > 1 needs an `answer` column in the dataset.")
        result = self._generate_rollout([ids for ids in prompt_ids for _ in range(factor)])
        tags = self._call_format  # what the model wrote outside its calls is read in its own format
        keep = []
        for g in range(0, len(prompts), group):
            rows = range(g * factor, (g + group) * factor)
            answer = inputs[g]["answer"]
            correct = [is_correct(None, answer, result.model_text[r], tags) for r in rows]
            problems = [result.num_tool_errors[r] + result.num_void_turns[r] for r in rows]
            keep += [rows[i] for i in resample_on_correct(correct, problems, group, self._roc_rng)]
        return select_rows(result, keep)


@contextlib.contextmanager
def _checkpointing_alias_quiet():
    """TRL 1.16's generation helpers (`unwrap_model_for_generation`, `disable_gradient_checkpointing`) read
    `is_gradient_checkpointing`, an alias transformers >= 5.3 deprecates: a FutureWarning at every step that is none
    of the user's doing. Only that message is silenced, only around TRL's generation step."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*`(is_)?gradient_checkpointing\w*` is deprecated", category=FutureWarning
        )
        yield
