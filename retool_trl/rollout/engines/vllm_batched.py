"""The vLLM turn backend of the interleaved rollout, and weight sync for vLLM's CPU build.

`VLLMBackend` drives TRL's own vLLM helper (`trainer.vllm_generation`, colocate or server mode): one engine call per
turn and per stop setting. Rows that may still call code stop at the code-end tag; rows that may not (no calls left)
run in their own call without that stop, so a `</code>` they write costs no extra engine call.

`use_reload_weights_on_cpu` routes TRL's colocate weight sync through vLLM's reload API when the engine runs on vLLM's
CPU platform, whose linear layers are repacked after loading and no longer accept TRL's per-parameter `load_weights`.
"""

from __future__ import annotations

import contextlib
import types

import torch

from ...format.parsing import first_stop  # noqa: F401 - re-exported (tests import it from here)
from ..turns import finish_turn, turn_stops, user_stop_ids, user_stops
from ..types import TurnOutput
from .vllm_colocate import sleep_after_rollout, wake_for_rollout


class VLLMBackend:
    """Turn generation through TRL's own vLLM helper (`trainer.vllm_generation`, colocate or server mode).

    Each turn continues `prompt + completion so far` as token ids, so vLLM's prefix cache serves the earlier turns.
    Rows are grouped by stop setting: one engine call for the rows that stop at the code-end tag (kept in the output),
    one for the rows that no longer may call code. Weight sync, sampling settings and importance sampling stay TRL's.
    Token alignment: we keep whole tokens only. If vLLM returns tokens past the one completing the tag, they are cut
    here; the text inside that last token does not matter, since the rollout works on token ids.

    Args:
        vllm_generation: TRL's `VLLMGeneration` (or an object with its `generate` interface and the attributes
            `max_completion_length` and `generation_kwargs`).
        tokenizer: The policy tokenizer.
        code_end: The code-end tag.
        accelerator: For server mode with several training processes, whose `generate` calls are collective: every
            process then makes the same calls per turn, with the same number of sequences, until all are done.
        profiler: Factory of a context manager around each call (TRL's `profiling_context`).
        max_model_len: The server's context limit (server mode): TRL's client sends one `max_tokens` for all prompts
            of a call, which vLLM refuses whole (HTTP 400) when any prompt plus it passes the limit, so the prompts
            that would not fit beside the others go in requests of their own.
    """

    def __init__(self, vllm_generation, tokenizer, code_end: str, accelerator=None, profiler=None, max_model_len=None):
        self.vllm_generation = vllm_generation
        self.tokenizer = tokenizer
        self.code_end = code_end
        self.accelerator = accelerator
        self.profiler = profiler
        self.max_model_len = max_model_len
        # TRL's helper gathers prompts across processes in server mode and across the tensor-parallel group in
        # colocate mode; both then need the same number of sequences and the same sampling settings everywhere.
        self.collective = (
            accelerator is not None
            and accelerator.num_processes > 1
            and (
                getattr(vllm_generation, "mode", "colocate") == "server"
                or getattr(vllm_generation, "tensor_parallel_size", 1) > 1
            )
        )
        self.engine_calls = 0  # helper.generate calls of this backend (the rollout reports them per rollout)
        self._sleep_paused = False

    def any_active(self, has_active: bool) -> bool:
        """Whether any process still has sequences to continue (the rollout loops while this holds)."""
        if not self.collective:
            return has_active
        flag = torch.tensor([int(has_active)], device=self.accelerator.device)
        return bool(self.accelerator.gather(flag).max().item())

    def generate_turn(self, sequences, max_new_tokens, stop_at_code_end) -> list[TurnOutput]:
        groups = {stop: [i for i, s in enumerate(stop_at_code_end) if bool(s) == stop] for stop in (True, False)}
        plan = {stop: (len(rows), max((max_new_tokens[i] for i in rows), default=0)) for stop, rows in groups.items()}
        counts = None
        if self.collective:  # every process makes the same calls with the same sizes (the largest of each group)
            local = torch.tensor([*plan[True], *plan[False]], device=self.accelerator.device)
            every = self.accelerator.gather(local).view(-1, 4)
            agreed = every.max(dim=0).values.tolist()
            plan = {True: (int(agreed[0]), int(agreed[1])), False: (int(agreed[2]), int(agreed[3]))}
            counts = {True: every[:, 0].tolist(), False: every[:, 2].tolist()}  # real rows of each process
        stops = user_stops(self.vllm_generation.generation_kwargs)
        stop_ids = user_stop_ids(self.vllm_generation.generation_kwargs)
        outputs: list[TurnOutput | None] = [None] * len(sequences)
        for stop in (True, False):
            total, max_tokens = plan[stop]
            if total == 0:
                continue
            rows = groups[stop]
            # Padding rows (other processes have more sequences in this group) are dropped; in server mode they are
            # not even sent (see `_without_padding`).
            prompts = [list(sequences[i]) for i in rows] + [[self.tokenizer.eos_token_id]] * (total - len(rows))
            with self._server_requests(counts[stop] if counts else None, total):
                completion_ids, logprobs = self._call(
                    prompts, max(max_tokens, 1), turn_stops(self.code_end, stops, stop)
                )
            for k, i in enumerate(rows):
                # TRL's helper returns top-k logprobs per token; the first is the sampled token's.
                lps = [lp[0] for lp in logprobs[k]] if logprobs is not None else None
                outputs[i] = finish_turn(
                    completion_ids[k], lps, self.tokenizer, self.code_end, stops, stop, max_new_tokens[i], stop_ids
                )
        return outputs

    @contextlib.contextmanager
    def _server_requests(self, counts: list[int] | None, total: int):
        """In server mode, the main process sends only real rows, each with a token budget that fits its context.

        TRL's helper gathers `total` prompts from every process and sends them in one request with one token budget
        (the group's largest). A padding row (other processes have more rows) would make the shared server decode up
        to that budget for nothing, and a row whose context leaves less room than that budget makes vLLM refuse the
        whole request. Around the call, the main process's client sends only the real rows, split into requests
        whose budget fits every prompt of each, and answers the padding rows with an empty completion, which their
        process drops; TRL's gathering, slicing and sampling settings stay as they are.
        """
        client = getattr(self.vllm_generation, "vllm_client", None)
        if client is None or getattr(self.vllm_generation, "mode", None) != "server":
            yield
            return
        counts = counts if counts is not None else [total]
        real = [rank * total + k for rank, count in enumerate(counts) for k in range(int(count))]
        send, own = client.generate, vars(client).get("generate")
        limit = self.max_model_len

        def generate(prompts, max_tokens=16, **kwargs):
            full = {"prompt_ids": [list(p) for p in prompts]}
            for part, budget in _fitting_requests([(j, len(prompts[j])) for j in real], max_tokens, limit):
                sent = dict(kwargs)
                if isinstance(sent.get("features"), list):  # per-prompt features travel with their prompts
                    sent["features"] = [kwargs["features"][j] for j in part]
                reply = send(prompts=[prompts[j] for j in part], max_tokens=budget, **sent)
                for key in ("completion_ids", "logprobs", "logprob_token_ids"):
                    if reply.get(key) is None:
                        continue
                    values = full.setdefault(key, [[] for _ in prompts])
                    for j, value in zip(part, reply[key], strict=True):
                        values[j] = value
            return full

        client.generate = generate
        try:
            yield
        finally:
            if own is None:
                del client.generate  # the class's method again
            else:
                client.generate = own

    def _call(self, prompts: list[list[int]], max_tokens: int, stops: list[str]):
        """One `helper.generate` call with this group's token budget and stop strings (restored afterwards)."""
        self._keep_awake()
        helper = self.vllm_generation
        saved = helper.max_completion_length, helper.generation_kwargs
        kwargs = dict(saved[1] or {})
        kwargs.pop("stop", None)
        if stops:  # the user's stop strings on every turn, the code-end tag while calls are left
            kwargs.update(stop=stops, include_stop_str_in_output=True)
        helper.max_completion_length, helper.generation_kwargs = max_tokens, kwargs
        self.engine_calls += 1
        try:
            _, completion_ids, logprobs, _ = helper.generate(
                prompts=prompts, images=None, num_generations=1, profiler=self.profiler() if self.profiler else None
            )
        finally:
            helper.max_completion_length, helper.generation_kwargs = saved
        return completion_ids, logprobs

    def _keep_awake(self) -> None:
        # With sleep mode, TRL's helper sleeps (and later re-syncs all weights) after every call; a rollout makes a
        # call per turn, so wake the engine once and put it back to sleep in `finish`.
        self._sleep_paused |= wake_for_rollout(self.vllm_generation)

    def finish(self) -> None:
        """Called by the rollout at its end: restores the helper's sleep mode."""
        if self._sleep_paused:
            sleep_after_rollout(self.vllm_generation)
            self._sleep_paused = False


def _fitting_requests(rows: list[tuple[int, int]], max_tokens: int, limit: int | None):
    """`(row indices, max_tokens)` of each request for `rows` (`(index, prompt length)`): every prompt gets the most
    of `max_tokens` its context leaves (`limit - length`), and a request's one budget fits all its prompts."""
    if not limit:
        return [([j for j, _ in rows], max_tokens)] if rows else []
    budgets = {j: max(1, min(max_tokens, limit - length)) for j, length in rows}
    requests, left = [], sorted(budgets, key=lambda j: -budgets[j])
    while left:
        budget = budgets[left[0]]
        part = [j for j in left if budgets[j] >= budget]
        requests.append((sorted(part), budget))
        left = [j for j in left if budgets[j] < budget]
    return requests


def use_reload_weights_on_cpu(vllm_generation) -> bool:
    """Routes TRL's colocate weight sync through vLLM's reload API when the engine runs on vLLM's CPU platform.

    vLLM's CPU build repacks linear weights after loading (for its CPU kernels), so the parameters lose the
    `weight_loader` that TRL's per-parameter `model.load_weights` needs. `model_runner.reload_weights` takes the same
    (name, tensor) stream and repacks again. Everything else (server mode, GPUs, PEFT merging, FSDP/ZeRO-3 gathering,
    which parameters are sent) stays TRL's: only the final load call differs.

    Args:
        vllm_generation: TRL's `VLLMGeneration` (the trainer's `vllm_generation`).

    Returns:
        Whether the sync was rerouted (colocate mode on vLLM's CPU platform).
    """
    if getattr(vllm_generation, "mode", None) != "colocate":
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    vllm_generation.sync_weights = types.MethodType(_sync_weights_by_reload, vllm_generation)
    return True


def _sync_weights_by_reload(helper) -> None:
    # Sleep mode is not supported on vLLM's CPU platform, so there is nothing to wake up. The generator is consumed
    # inside `reload_weights`, while TRL's iterator still holds merged PEFT adapters / gathered shards.
    model_runner = helper.llm.llm_engine.model_executor.driver_worker.model_runner
    model_runner.reload_weights(weights_iterator=helper._iter_named_params())
    _refresh_tied_lm_head(model_runner.get_model())
    helper.llm.reset_prefix_cache()


def _refresh_tied_lm_head(model) -> None:
    # With tied embeddings the LM head receives no weight of its own during a reload, so vLLM keeps the kernel
    # tensors it packed from the old embedding. Tie it to the new embedding again and let it repack.
    lm_head, config = getattr(model, "lm_head", None), getattr(model, "config", None)
    if lm_head is None or not getattr(config, "tie_word_embeddings", False) or not hasattr(lm_head, "quant_method"):
        return
    embed = next((m for name, m in model.named_modules() if name.endswith("embed_tokens")), None)
    if embed is None:
        return
    lm_head.weight = embed.weight
    lm_head.quant_method.process_weights_after_loading(lm_head)
