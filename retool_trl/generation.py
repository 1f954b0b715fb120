"""Generation backends for the interleaved rollout: one turn of batched generation that stops at the code-end tag.

`TransformersBackend` wraps `model.generate` with TRL's `GenerationConfig` (sampling settings come from GRPOConfig)
and a stopping criterion that ends each sequence at EOS, at its own token budget, or at the token completing the
code-end tag (transformers' `StopStringCriteria`, which also catches the tag inside a longer token).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList, StopStringCriteria

from .rollout import TurnOutput


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
    """Turn generation with `model.generate` (CPU or GPU).

    Args:
        model: The (unwrapped) causal LM.
        tokenizer: Its tokenizer (for padding and the stop-string tables).
        generation_config: Sampling settings, e.g. TRL's `trainer.generation_config`.
        code_end: The code-end tag.
        eos_token_ids: Token ids that end a completion.
    """

    def __init__(self, model, tokenizer, generation_config: GenerationConfig, code_end: str, eos_token_ids):
        self.model = model
        self.tokenizer = tokenizer
        self.generation_config = copy.deepcopy(generation_config)
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        # Built once: transformers precomputes vocabulary tables for the stop string.
        self.code_end_criterion = StopStringCriteria(tokenizer=tokenizer, stop_strings=[code_end])

    @torch.no_grad()
    def generate_turn(
        self, sequences: Sequence[Sequence[int]], max_new_tokens: Sequence[int], stop_at_code_end: Sequence[bool]
    ) -> list[TurnOutput]:
        device = self.model.device
        width = max(len(s) for s in sequences)
        input_ids = torch.full((len(sequences), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for i, seq in enumerate(sequences):  # left padding, as decoder-only generation expects
            input_ids[i, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
            attention_mask[i, width - len(seq) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        stopper = _TurnStopper(
            self.code_end_criterion if any(stop_at_code_end) else None,
            width,
            list(max_new_tokens),
            list(stop_at_code_end),
            self.eos_token_ids,
            device,
        )
        config = copy.copy(self.generation_config)
        config.max_new_tokens = max(max_new_tokens)
        config.pad_token_id = self.pad_token_id
        output = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([stopper]),
        )
        new_tokens = output[:, width:].tolist()
        lengths = stopper.stop_len.tolist()
        return [
            TurnOutput(tokens[: n if n >= 0 else budget])
            for tokens, n, budget in zip(new_tokens, lengths, max_new_tokens, strict=True)
        ]
