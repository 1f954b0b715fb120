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
        logits_processor (*optional*): Extra `LogitsProcessorList` for `generate` (constrained decoding, tests), or
            a callable returning a fresh one for each turn (for stateful processors).
    """

    def __init__(
        self, model, tokenizer, generation_config: GenerationConfig, code_end: str, eos_token_ids, logits_processor=None
    ):
        self.model = model
        self.logits_processor = logits_processor
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
            logits_processor=self.logits_processor() if callable(self.logits_processor) else self.logits_processor,
        )
        new_tokens = output[:, width:].tolist()
        lengths = stopper.stop_len.tolist()
        return [
            TurnOutput(tokens[: n if n >= 0 else budget])
            for tokens, n, budget in zip(new_tokens, lengths, max_new_tokens, strict=True)
        ]


def first_stop(token_ids: Sequence[int], tokenizer, stop_string: str) -> int | None:
    """Length of the shortest prefix of `token_ids` whose text contains `stop_string`, or `None`.

    Binary search over prefixes (containment only grows with the prefix), so a long turn costs O(log n) decodes.
    """
    if stop_string not in tokenizer.decode(token_ids):
        return None
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if stop_string in tokenizer.decode(token_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


class VLLMBackend:
    """Turn generation through TRL's own vLLM helper (`trainer.vllm_generation`, colocate or server mode).

    Each turn continues `prompt + completion so far` as token ids with a stop at the code-end tag (kept in the output),
    so vLLM's prefix cache serves the earlier turns. Weight sync, sampling settings and importance sampling stay TRL's.
    Token alignment: we keep whole tokens only. If vLLM returns tokens past the one completing the tag, they are cut
    here; the text inside that last token does not matter, since the rollout works on token ids.

    Args:
        vllm_generation: TRL's `VLLMGeneration` (or an object with its `generate` interface and the attributes
            `max_completion_length` and `generation_kwargs`).
        tokenizer: The policy tokenizer.
        code_end: The code-end tag.
        accelerator: For server mode with several training processes, whose `generate` calls are collective: every
            process then calls once per turn, with the same number of sequences, until all are done.
        profiler: Factory of a context manager around each call (TRL's `profiling_context`).
    """

    def __init__(self, vllm_generation, tokenizer, code_end: str, accelerator=None, profiler=None):
        self.vllm_generation = vllm_generation
        self.tokenizer = tokenizer
        self.code_end = code_end
        self.accelerator = accelerator
        self.profiler = profiler
        self.collective = (
            accelerator is not None
            and accelerator.num_processes > 1
            and getattr(vllm_generation, "mode", "colocate") == "server"
        )

    def any_active(self, has_active: bool) -> bool:
        """Whether any process still has sequences to continue (the rollout loops while this holds)."""
        if not self.collective:
            return has_active
        flag = torch.tensor([int(has_active)], device=self.accelerator.device)
        return bool(self.accelerator.gather(flag).max().item())

    def generate_turn(self, sequences, max_new_tokens, stop_at_code_end) -> list[TurnOutput]:
        sequences, budgets = [list(s) for s in sequences], list(max_new_tokens)
        real = len(sequences)
        if self.collective:  # equal counts on every process: the helper slices the gathered batch evenly
            counts = self.accelerator.gather(torch.tensor([real], device=self.accelerator.device))
            filler = [self.tokenizer.eos_token_id]
            sequences += [filler] * (int(counts.max().item()) - real)
            budgets += [1] * (len(sequences) - real)
        if not sequences:
            return []
        helper = self.vllm_generation
        saved = helper.max_completion_length, helper.generation_kwargs
        kwargs = dict(saved[1] or {})
        if any(stop_at_code_end):
            kwargs.update(stop=[self.code_end], include_stop_str_in_output=True)
        helper.max_completion_length, helper.generation_kwargs = max(budgets), kwargs
        try:
            _, completion_ids, logprobs, _ = helper.generate(
                prompts=sequences,
                images=None,
                num_generations=1,
                profiler=self.profiler() if self.profiler else None,
            )
        finally:
            helper.max_completion_length, helper.generation_kwargs = saved
        outputs = []
        for i in range(real):
            ids = list(completion_ids[i])[: budgets[i]]
            if stop_at_code_end[i] and (cut := first_stop(ids, self.tokenizer, self.code_end)) is not None:
                ids = ids[:cut]
            # TRL's helper returns top-k logprobs per token; the first is the sampled token's.
            lps = [lp[0] for lp in logprobs[i][: len(ids)]] if logprobs is not None else None
            outputs.append(TurnOutput(ids, lps))
        return outputs
