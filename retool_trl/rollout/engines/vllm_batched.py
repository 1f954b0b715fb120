"""The vLLM turn backend of the interleaved rollout, and weight sync for vLLM's CPU build.

`VLLMBackend` drives TRL's own vLLM helper (`trainer.vllm_generation`, colocate or server mode): one engine call per
turn and per stop setting. Rows that may still call code stop at the code-end tag; rows that may not (no calls left)
run in their own call without that stop, so a `</code>` they write costs no extra engine call.

`use_reload_weights_on_cpu` routes TRL's colocate weight sync through vLLM's reload API when the engine runs on vLLM's
CPU platform, whose linear layers are repacked after loading and no longer accept TRL's per-parameter `load_weights`.
"""

from __future__ import annotations

import contextlib
import math
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import torch

from ...format.parsing import first_stop  # noqa: F401 - re-exported (tests import it from here)
from ..turns import EngineError, finish_turn, fitting_parts, turn_stops, user_stop_ids, user_stops
from ..types import TurnOutput
from .vllm_colocate import sleep_after_rollout, wake_for_rollout

# Requests of one turn in flight at once from the main process (TRL's client sends up to 64 per-prompt requests).
_MAX_CONCURRENT_REQUESTS = 64


class FailedRequest(str):
    """Stands for each row's prompt ids when a request of the main process failed (the server refused it, a
    connection dropped). It travels in TRL's broadcast to every process, which then raises the same error: raised on
    the main process alone, the others would wait in that broadcast until the process group's timeout."""


def kept_from_logprobs(token_ids: list[list[int]], logprobs: list[list[float | None]]) -> list[list[int]]:
    """Each token's kept set from TRL's per-token top log-probs and their token ids: the tokens whose processed
    log-prob is finite (vLLM gives a token the truncation removed `-inf`, its server -9999.0)."""
    return [
        [t for t, lp in zip(ids, lps, strict=True) if lp is not None and -9999.0 < lp < math.inf]
        for ids, lps in zip(token_ids, logprobs, strict=True)
    ]


def sampled_logprobs(
    completion_ids: list[int], logprobs: list[list[float | None]], logprob_ids: list[list[int]] | None
) -> list[float | None]:
    """Each sampled token's log-prob from TRL's per-token top log-probs, picked by token id: TRL returns them in rank
    order (most probable first), and the sampled token is not the most probable one wherever sampling did not take
    the mode. Without token ids (`logprob_ids` None), TRL was asked for the sampled token's alone (`logprobs=0`)."""
    if logprob_ids is None:
        return [lp[0] for lp in logprobs]
    if len(logprob_ids) != len(completion_ids):  # `finish_turn` explains the count mismatch
        return [lp[0] for lp in logprobs]
    picked = []
    for t, (token, lps_t, ids_t) in enumerate(zip(completion_ids, logprobs, logprob_ids, strict=True)):
        try:
            picked.append(lps_t[ids_t.index(token)])
        except ValueError:
            raise EngineError(
                f"TRL's vLLM helper returned no log-prob for the sampled token {token} at position {t} (its top "
                f"log-probs are of {ids_t[:8]}): the sampling log-probs cannot be read"
            ) from None
    return picked


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
        replay: With truncated sampling and the importance-sampling correction, each sampled token's kept set is
            read from the processed log-probs of the top `replay.top_k` tokens TRL's helper returns (those the
            truncation removed are `-inf`; TRL's helper does not pass vLLM's sampling mask on); `None` asks for none.
    """

    def __init__(
        self,
        vllm_generation,
        tokenizer,
        code_end: str,
        accelerator=None,
        profiler=None,
        max_model_len=None,
        replay=None,
    ):
        self.vllm_generation = vllm_generation
        self.replay = replay
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
        # A colocated tensor-parallel engine's calls are collective within its group only (TRL gathers the prompts
        # there), so the group agrees on its own and stops when its own rows are done; with PEFT, TRL also puts a
        # barrier on every process in each call, and then the whole world agrees.
        self._tp_group = None
        if self.collective and getattr(vllm_generation, "mode", "colocate") == "colocate":
            if not hasattr(getattr(vllm_generation, "model", None), "peft_config"):
                self._tp_group = getattr(vllm_generation, "tp_group", None)
        self.engine_calls = 0  # helper.generate calls of this backend (the rollout reports them per rollout)
        self._sleep_paused = False

    def any_active(self, has_active: bool) -> bool:
        """Whether any process that shares this one's engine calls still has sequences to continue (the rollout
        loops while this holds)."""
        if not self.collective:
            return has_active
        flag = torch.tensor([int(has_active)], device=self.accelerator.device)
        return bool(self._gather(flag).max().item())

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` of every process that shares the engine calls (the tensor-parallel group, or every process),
        concatenated in process order."""
        if self._tp_group is None:
            return self.accelerator.gather(tensor)
        parts = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(self._tp_group))]
        torch.distributed.all_gather(parts, tensor, group=self._tp_group)
        return torch.cat(parts)

    def generate_turn(self, sequences, max_new_tokens, stop_at_code_end) -> list[TurnOutput]:
        groups = {stop: [i for i, s in enumerate(stop_at_code_end) if bool(s) == stop] for stop in (True, False)}
        plan = {stop: (len(rows), max((max_new_tokens[i] for i in rows), default=0)) for stop, rows in groups.items()}
        counts = None
        if self.collective:  # every process makes the same calls with the same sizes (the largest of each group)
            local = torch.tensor([*plan[True], *plan[False]], device=self.accelerator.device)
            every = self._gather(local).view(-1, 4)
            agreed = every.max(dim=0).values.tolist()
            plan = {True: (int(agreed[0]), int(agreed[1])), False: (int(agreed[2]), int(agreed[3]))}
            counts = {True: every[:, 0].tolist(), False: every[:, 2].tolist()}  # real rows of each process
        budgets = self._row_budgets(groups, plan, max_new_tokens)
        stops = user_stops(self.vllm_generation.generation_kwargs)
        stop_ids = user_stop_ids(self.vllm_generation.generation_kwargs)
        outputs: list[TurnOutput | None] = [None] * len(sequences)
        for stop in (True, False):
            total, max_tokens = plan[stop]
            if total == 0:
                continue
            rows = groups[stop]
            # Padding rows (other processes have more sequences in this group) are dropped; in server mode they are
            # not even sent (see `_server_requests`).
            prompts = [list(sequences[i]) for i in rows] + [[self.tokenizer.eos_token_id]] * (total - len(rows))
            with (
                self._server_requests(counts[stop] if counts else None, total, budgets.get(stop)),
                self._short_padding(counts[stop] if counts else None, total),
            ):
                echoed, completion_ids, logprobs, logprob_ids = self._call(
                    prompts, max(max_tokens, 1), turn_stops(self.code_end, stops, stop)
                )
            failed = next((e for e in echoed or () if isinstance(e, FailedRequest)), None)
            if failed is not None:  # on every process alike, padding rows included
                raise RuntimeError(f"the vLLM server failed a generation request: {failed}")
            for k, i in enumerate(rows):
                if echoed is not None and echoed[k] is None:  # the server aborted this row's request
                    outputs[i] = TurnOutput([], [], aborted=True)
                    continue
                lps = None
                if logprobs is not None:
                    ids_k = logprob_ids[k] if logprob_ids is not None else None
                    lps = sampled_logprobs(completion_ids[k], logprobs[k], ids_k)
                kept = None
                if self.replay is not None:
                    if logprobs is None or logprob_ids is None:  # stop rather than train on a biased correction
                        raise RuntimeError(
                            "TRL's vLLM helper returned no top log-probs for a turn sampled with truncation: the "
                            "importance-sampling correction cannot be replayed"
                        )
                    kept = kept_from_logprobs(logprob_ids[k], logprobs[k])
                outputs[i] = finish_turn(
                    completion_ids[k],
                    lps,
                    self.tokenizer,
                    self.code_end,
                    stops,
                    stop,
                    max_new_tokens[i],
                    stop_ids,
                    kept=kept,
                )
        return outputs

    @contextlib.contextmanager
    def _short_padding(self, counts: list[int] | None, total: int):
        """With a colocated tensor-parallel engine, padding rows (another process of the group has more rows) are
        decoded for one token, not up to the group's budget: TRL's helper sends the group's prompts to `llm.generate`
        with one `SamplingParams`; around the call, the padding prompts get a copy limited to one token."""
        helper = self.vllm_generation
        tp, llm = getattr(helper, "tensor_parallel_size", 1), getattr(helper, "llm", None)
        if counts is None or tp <= 1 or llm is None or getattr(helper, "mode", "colocate") != "colocate":
            yield
            return
        if self._tp_group is None:  # counts of every process: this group's members are `tp` consecutive ones
            first = self.accelerator.process_index // tp * tp
            counts = counts[first : first + tp]
        padding = {member * total + k for member, count in enumerate(counts) for k in range(int(count), total)}
        generate, own = llm.generate, vars(llm).get("generate")

        def short_padding(prompts, sampling_params=None, *args, **kwargs):
            if padding and hasattr(sampling_params, "clone") and len(prompts) == tp * total:
                short = sampling_params.clone()
                short.max_tokens = 1
                sampling_params = [short if j in padding else sampling_params for j in range(len(prompts))]
            return generate(prompts, sampling_params, *args, **kwargs)

        llm.generate = short_padding
        try:
            yield
        finally:
            if own is None:
                vars(llm).pop("generate", None)
            else:
                llm.generate = own

    def _row_budgets(self, groups, plan, max_new_tokens) -> dict[bool, list[int]]:
        """In server mode with a context limit, each row's own token budget, as the main process sees the rows of
        every process (`total` slots per process and stop setting, 0 for padding): the requests are cut by budget
        (`fitting_parts`), and the budget a row's context allows (`limit - length`) is not its own budget: with a
        limit sized as TRL advises, it differs for every row, and each row would go in a request of its own.

        A collective call in server mode with several processes, made by every process whatever it knows: only the
        main process has TRL's client, and each asks the server for its limit on its own."""
        if getattr(self.vllm_generation, "mode", None) != "server" or not (self.max_model_len or self.collective):
            return {}
        slots = {stop: [max_new_tokens[i] for i in groups[stop]] for stop in (True, False)}
        slots = {stop: values + [0] * (plan[stop][0] - len(values)) for stop, values in slots.items()}
        if not self.collective:
            return slots
        local = torch.tensor(slots[True] + slots[False], dtype=torch.long, device=self.accelerator.device)
        every = self.accelerator.gather(local).view(self.accelerator.num_processes, -1).tolist()
        width = plan[True][0]
        return {True: [b for row in every for b in row[:width]], False: [b for row in every for b in row[width:]]}

    def _server_client(self):
        """TRL's `VLLMClient` in server mode (the main process's; `None` elsewhere and in colocate mode)."""
        if getattr(self.vllm_generation, "mode", None) != "server":
            return None
        return getattr(self.vllm_generation, "vllm_client", None)

    @contextlib.contextmanager
    def _server_requests(self, counts: list[int] | None, total: int, budgets: list[int] | None = None):
        """In server mode, the main process sends only real rows, in concurrent requests whose budget fits them.

        TRL's helper gathers `total` prompts from every process and sends them in one request with one token budget
        (the group's largest). A padding row (other processes have more rows) would make the shared server decode up
        to that budget for nothing, and a row whose context leaves less room than that budget makes vLLM refuse the
        whole request. Around the call, the main process's client sends only the real rows, split as the async
        engine splits its turns (`fitting_parts`, by each row's own budget `budgets`), the requests at once from
        threads (as TRL's client sends its per-prompt requests), and answers the padding rows with an empty
        completion, which their process drops. A row whose request vLLM aborted (`finish_reason` "abort": a weight
        update in pause mode, a restart) is echoed with `None` for its prompt ids, which TRL's helper hands back to
        every process as it is. TRL's gathering, slicing and sampling settings stay as they are.
        """
        client = self._server_client()
        if client is None:
            yield
            return
        counts = counts if counts is not None else [total]
        real = [rank * total + k for rank, count in enumerate(counts) for k in range(int(count))]
        send, own = client.generate, vars(client).get("generate")
        post, own_post = getattr(client, "_post", None), vars(client).get("_post")
        limit, reasons = self.max_model_len, threading.local()

        def post_recording(url, **kwargs):
            reply = post(url, **kwargs)
            reasons.value = [choice.get("finish_reason") for choice in reply.get("choices") or []]
            return reply

        def generate(prompts, max_tokens=16, **kwargs):
            full = {"prompt_ids": [list(p) for p in prompts]}
            # Each real row's own budget (the rows of every process, from `_row_budgets`); the group's without one.
            wanted = {j: max(1, min(max_tokens, budgets[j])) if budgets else max_tokens for j in real}
            parts = fitting_parts([len(prompts[j]) for j in real], [wanted[j] for j in real], limit)
            parts = [[real[k] for k in part] for part in parts]

            def request(part):
                sent = dict(kwargs)
                if isinstance(sent.get("features"), list):  # per-prompt features travel with their prompts
                    sent["features"] = [kwargs["features"][j] for j in part]
                reasons.value = None
                reply = send(prompts=[prompts[j] for j in part], max_tokens=max(wanted[j] for j in part), **sent)
                return reply, reasons.value

            try:
                with ThreadPoolExecutor(max_workers=max(1, min(len(parts), _MAX_CONCURRENT_REQUESTS))) as pool:
                    replies = list(pool.map(request, parts))
            except Exception as exc:  # noqa: BLE001 - every process must learn it (see `FailedRequest`)
                failed = FailedRequest(f"{type(exc).__name__}: {exc}")
                return {"prompt_ids": [failed] * len(prompts), "completion_ids": [[]] * len(prompts), "logprobs": None}
            for part, (reply, finish_reasons) in zip(parts, replies, strict=True):
                for key in ("completion_ids", "logprobs", "logprob_token_ids"):
                    if reply.get(key) is None:
                        continue
                    values = full.setdefault(key, [[] for _ in prompts])
                    for j, value in zip(part, reply[key], strict=True):
                        values[j] = value
                for j, reason in zip(part, finish_reasons or [], strict=False):
                    if reason == "abort":
                        full["prompt_ids"][j] = None
            return full

        client.generate = generate
        if post is not None:  # TRL's client posts every request through `_post`: the finish reasons are read there
            client._post = post_recording
        try:
            yield
        finally:
            for name, value in (("generate", own), ("_post", own_post)):
                if value is None:
                    vars(client).pop(name, None)  # the class's method again
                else:
                    setattr(client, name, value)

    def _call(self, prompts: list[list[int]], max_tokens: int, stops: list[str]):
        """One `helper.generate` call with this group's token budget and stop strings (restored afterwards)."""
        self._keep_awake()
        helper = self.vllm_generation
        saved = helper.max_completion_length, helper.generation_kwargs, getattr(helper, "logprobs", 0)
        kwargs = dict(saved[1] or {})
        kwargs.pop("stop", None)
        if stops:  # the user's stop strings on every turn, the code-end tag while calls are left
            kwargs.update(stop=stops, include_stop_str_in_output=True)
        if self.replay is not None:  # the top_k log-probs carry the kept set (the vocabulary without a top_k)
            kwargs["top_k"] = self.replay.top_k
            helper.logprobs = max(saved[2] or 0, self.replay.num_logprobs)
        helper.max_completion_length, helper.generation_kwargs = max_tokens, kwargs
        self.engine_calls += 1
        try:
            prompt_ids, completion_ids, logprobs, logprob_ids = helper.generate(
                prompts=prompts, images=None, num_generations=1, profiler=self.profiler() if self.profiler else None
            )
        finally:
            helper.max_completion_length, helper.generation_kwargs = saved[:2]
            if self.replay is not None:
                helper.logprobs = saved[2]
        return prompt_ids, completion_ids, logprobs, logprob_ids

    def _keep_awake(self) -> None:
        # With sleep mode, TRL's helper sleeps (and later re-syncs all weights) after every call; a rollout makes a
        # call per turn, so wake the engine once and put it back to sleep in `finish`.
        self._sleep_paused |= wake_for_rollout(self.vllm_generation)

    def finish(self) -> None:
        """Called by the rollout at its end: restores the helper's sleep mode."""
        if self._sleep_paused:
            sleep_after_rollout(self.vllm_generation)
            self._sleep_paused = False


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
