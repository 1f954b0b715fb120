"""Generation backends for the interleaved rollout: one turn of batched generation that stops at the code-end tag.

`TransformersBackend` wraps `model.generate` with TRL's `GenerationConfig` (sampling settings come from GRPOConfig)
and a stopping criterion that ends each sequence at EOS, at its own token budget, or at the token completing the
code-end tag (transformers' `StopStringCriteria`, which also catches the tag inside a longer token).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.distributed as dist
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList, StopStringCriteria
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.generation import utils as _generation_utils
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

try:
    from transformers.distributed.fsdp import is_fsdp_managed_module
except ImportError:  # older transformers 5.x

    def is_fsdp_managed_module(module) -> bool:
        return getattr(module, "_is_fsdp_managed_module", False)


from ..types import TurnOutput

# transformers 5.2x renamed `generate(past_key_values=...)` and `output.past_key_values` to `cache` (the old names go
# in 6.0); older 5.x releases inside the pinned range only know the old one.
_CACHE_NAME = "cache" if "cache" in getattr(_generation_utils, "ALL_CACHE_NAMES", ()) else "past_key_values"


class _TurnStopper(StoppingCriteria):
    """Per-sequence stop: EOS, own budget, or the code-end tag (where enabled). Records where each one stopped."""

    def __init__(self, stop_string, prompt_len, budgets, stop_at_code_end, eos_token_ids, device):
        self.stop_string = stop_string
        self.prompt_len = prompt_len
        self.budgets = torch.tensor(budgets, device=device)
        self.code_end_enabled = torch.tensor(stop_at_code_end, device=device, dtype=torch.bool)
        self.eos = torch.tensor(sorted(eos_token_ids), device=device)
        self.stop_len = torch.full((len(budgets),), -1, device=device, dtype=torch.long)

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        generated = input_ids.shape[1] - self.prompt_len
        done = torch.isin(input_ids[:, -1], self.eos) | (self.budgets <= generated)
        if self.stop_string is not None:
            done |= self.stop_string(input_ids, scores) & self.code_end_enabled
        newly = done & (self.stop_len < 0)
        self.stop_len[newly] = generated
        return done | (self.stop_len >= 0)


class TransformersBackend:
    """Turn generation with `model.generate` (CPU or GPU), reusing the KV cache across turns.

    A turn continues the previous turn's batch: rows that are done are dropped from the cache, the interpreter tokens
    of the others are appended after a run of masked padding (so every row stays aligned with the cache), and only
    the new tokens are prefilled. Position ids follow the attention mask, so the holes change nothing for the model.
    Sequences that do not continue the previous turn (a new rollout) start a fresh batch.

    Args:
        model: The (unwrapped) causal LM.
        tokenizer: Its tokenizer (for padding and the stop-string tables).
        generation_config: Sampling settings, e.g. TRL's `trainer.generation_config`.
        code_end: The string a call ends at (its call format's `stop`); `None` where a turn's own end closes its calls.
        eos_token_ids: Token ids that end a completion.
        logits_processor (*optional*): Extra `LogitsProcessorList` for `generate` (constrained decoding, tests), or
            a callable returning a fresh one for each turn (for stateful processors).
        reuse_cache (`bool`, defaults to `True`): Keep the KV cache between turns instead of prefilling again.
    """

    def __init__(
        self,
        model,
        tokenizer,
        generation_config: GenerationConfig,
        code_end: str | None,
        eos_token_ids,
        logits_processor=None,
        reuse_cache: bool = True,
    ):
        self.model = model
        self.logits_processor = logits_processor
        # A repetition penalty would count the padding of the reused cache's holes (pad == eos for many tokenizers).
        self.reuse_cache = reuse_cache and generation_config.repetition_penalty in (None, 1.0)
        self.tokenizer = tokenizer
        self.generation_config = copy.deepcopy(generation_config)
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        # Built once: transformers precomputes vocabulary tables for the stop string.
        self.code_end_criterion = (
            StopStringCriteria(tokenizer=tokenizer, stop_strings=[code_end]) if code_end else None
        )
        self.finish()

    def finish(self) -> None:
        """Drops the state kept between turns (called by the rollout when it ends, to free the cache)."""
        self._cache, self._ids, self._mask, self._sequences = None, None, None, None

    def _synced(self) -> bool:
        # Under DeepSpeed ZeRO-3 or FSDP every `generate` is collective across processes (transformers' synced_gpus).
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return False
        return is_deepspeed_zero3_enabled() or is_fsdp_managed_module(self.model)

    def any_active(self, has_active: bool) -> bool:
        """Whether any process still has sequences: with collective generation, all keep turning until all are done."""
        if not self._synced():
            return has_active
        flag = torch.tensor([float(has_active)], device=self.model.device)
        dist.all_reduce(flag)
        return bool(flag.item())

    def _continued_rows(self, sequences) -> list[int] | None:
        """Indices of the previous turn's rows that `sequences` continue, in order; `None` if they do not."""
        if self._cache is None:
            return None
        rows, j = [], 0
        for seq in sequences:
            while j < len(self._sequences) and list(seq[: len(self._sequences[j])]) != self._sequences[j]:
                j += 1
            if j == len(self._sequences):
                return None
            rows.append(j)
            j += 1
        return rows

    def _batch(self, sequences, device):
        """Input ids and attention mask: a fresh left-padded batch, or the previous batch plus the new tokens."""
        rows = self._continued_rows(sequences) if self.reuse_cache else None
        if rows is None:
            self.finish()
            width = max(len(s) for s in sequences)
            ids = torch.full((len(sequences), width), self.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(sequences), width), dtype=torch.long)
            for i, seq in enumerate(sequences):  # left padding, as decoder-only generation expects
                ids[i, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
                mask[i, width - len(seq) :] = 1
            return ids.to(device), mask.to(device), None
        index = torch.tensor(rows, device=device)
        kept_mask = self._mask[index]
        suffixes = []
        for i, (seq, j) in enumerate(zip(sequences, rows)):
            suffix = seq[len(self._sequences[j]) :]
            if not suffix:
                # Nothing new (the turn stopped at a code-end tag that opened no block): the next token must be
                # sampled from this row's last token, so feed it again at the end, after hiding its earlier copy
                # (the masked key stays in the cache unused; positions follow the mask, so nothing shifts).
                kept_mask[i, int(kept_mask[i].nonzero().max())] = 0
                suffix = seq[-1:]
            suffixes.append(suffix)
        extra = max(len(s) for s in suffixes)
        ids = torch.full((len(sequences), extra), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), extra), dtype=torch.long)
        for i, suffix in enumerate(suffixes):  # right-aligned: the padding hole sits before the new tokens
            ids[i, extra - len(suffix) :] = torch.tensor(suffix, dtype=torch.long)
            mask[i, extra - len(suffix) :] = 1
        cache = self._cache
        cache.batch_select_indices(index)
        ids = torch.cat([self._ids[index], ids.to(device)], dim=1)
        mask = torch.cat([kept_mask, mask.to(device)], dim=1)
        return ids, mask, cache

    @torch.no_grad()
    def generate_turn(
        self, sequences: Sequence[Sequence[int]], max_new_tokens: Sequence[int], stop_at_code_end: Sequence[bool]
    ) -> list[TurnOutput]:
        device = self.model.device
        if not sequences:  # done here but not on other processes: take part in their synced forward passes
            self.finish()
            one = torch.tensor([[self.pad_token_id]], device=device)
            self.model.generate(
                input_ids=one,
                attention_mask=torch.ones_like(one),
                max_new_tokens=1,
                generation_config=self.generation_config,
                synced_gpus=True,
            )
            return []
        input_ids, attention_mask, cache = self._batch(sequences, device)
        width = input_ids.shape[1]
        stopper = _TurnStopper(
            self.code_end_criterion if any(stop_at_code_end) and self.code_end_criterion else None,
            width,
            list(max_new_tokens),
            list(stop_at_code_end),
            self.eos_token_ids,
            device,
        )
        config = copy.copy(self.generation_config)
        config.max_new_tokens = max(max_new_tokens)
        config.pad_token_id = self.pad_token_id
        config.use_cache, config.return_dict_in_generate = True, True
        output = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([stopper]),
            logits_processor=self.logits_processor() if callable(self.logits_processor) else self.logits_processor,
            **{_CACHE_NAME: cache},
        )
        lengths = [n if n >= 0 else budget for n, budget in zip(stopper.stop_len.tolist(), max_new_tokens)]
        new_tokens = [tokens[:n] for tokens, n in zip(output.sequences[:, width:].tolist(), lengths, strict=True)]
        if self.reuse_cache:
            self._keep(sequences, output, attention_mask, lengths, new_tokens)
        return [TurnOutput(tokens) for tokens in new_tokens]

    def _keep(self, sequences, output, attention_mask, lengths, new_tokens) -> None:
        cache, ids = getattr(output, _CACHE_NAME), output.sequences
        # Holes in the mask are exact only for full attention over a plain dynamic cache: a static cache cannot drop
        # rows, a sliding window counts the holes as tokens, recurrent layers consume the padding. And generate never
        # feeds its last sampled token; if a transformers version did, positions would shift.
        longest = max(len(seq) + len(new) for seq, new in zip(sequences, new_tokens))
        if (
            not isinstance(cache, DynamicCache)
            or any(type(layer) is not DynamicLayer for layer in cache.layers)
            or cache.get_seq_length() != ids.shape[1] - 1
            or ids.shape[1] > 2 * longest + 64  # holes have grown: a fresh prefill compacts the batch
        ):
            self.finish()
            return
        steps = ids.shape[1] - attention_mask.shape[1]
        generated = (
            torch.arange(steps, device=ids.device).unsqueeze(0) < torch.tensor(lengths, device=ids.device)[:, None]
        )
        self._cache, self._ids = cache, ids
        self._mask = torch.cat([attention_mask, generated.long()], dim=1)  # tokens after a row's stop are padding
        self._sequences = [[*seq, *new] for seq, new in zip(sequences, new_tokens)]
