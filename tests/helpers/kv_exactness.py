"""Machinery of the KV-cache exactness check (`tests/rollout/test_kv_reuse_exact.py`), shared with
`scripts/gpu/gpu_check.py` so the same check runs on CUDA in fp32 and bf16. Imports no pytest."""

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from retool_trl.rollout import RolloutSpec, interleaved_rollout
from retool_trl.rollout.engines.transformers_generate import TransformersBackend
from retool_trl.testing import FakeSandbox

KEY = 3  # prompts differ in their first KEY tokens, which is how the forcing processor finds each row's script

# Per row: the scripted turns (each ends at a code-end tag, or with EOS after the last one), then free turns.
SCRIPTS = {
    "A0:": ["a</code>", "<code>print(7)</code>"],  # a stray tag: the turn adds nothing, the row goes on
    "B1:long prompt": ["<code lang=python>print(1)</code>", "x</code>"],  # no block opened, twice
    "C2:mid": ["<code>print('y' * 40)</code>", "<code>print(1)</code>"],  # interpreter blocks of different lengths
    "D3:x": ["\\boxed{3}"],  # ends with EOS in the first turn: dropped from the batch before the second
    "E4:": ["<code>1/0</code>", "ok</code>"],  # an error, then a stray tag right after an interpreter block
}


class Recorder(LogitsProcessor):
    """Keeps the raw scores of each step with the ids they were computed for (first in the list: before warpers)."""

    def __init__(self, log: list):
        self.log, self.start = log, None

    def __call__(self, input_ids, scores):
        self.start = input_ids.shape[1] if self.start is None else self.start
        self.log.append((input_ids.shape[1] - self.start, input_ids.clone(), scores.clone()))
        return scores


def record_attention_masks(model) -> tuple[list, object]:
    """The 2-D attention mask of every forward pass `generate` makes (one per step, in order), and the hook."""
    masks: list = []
    handle = model.register_forward_pre_hook(
        lambda _, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True
    )
    return masks, handle


class ForceTurn(LogitsProcessor):
    """Forces each row's scripted turn number `turn` (the row found by its first KEY prompt ids), then EOS; a row
    without one is left to the model. The turn is the call's index, not read from the ids, which may hold a token
    twice."""

    def __init__(self, scripts: dict, turn: int, tokenizer):
        self.scripts, self.turn, self.tokenizer, self.plan, self.start = scripts, turn, tokenizer, None, None

    def __call__(self, input_ids, scores):
        if self.plan is None:
            self.start, pad = input_ids.shape[1], self.tokenizer.pad_token_id
            keys = [tuple([t for t in row if t != pad][:KEY]) for row in input_ids.tolist()]
            self.plan = [self.scripts[k][self.turn] if self.turn < len(self.scripts[k]) else None for k in keys]
        step, scores = input_ids.shape[1] - self.start, scores.clone()
        for b, turn in enumerate(self.plan):
            if turn is not None:
                scores[b] = float("-inf")
                scores[b, turn[step] if step < len(turn) else self.tokenizer.eos_token_id] = 0.0
        return scores


def check_sampled_logits(model, tokenizer, sampling: dict, reuse_cache: bool, compare, seed: int = 0):
    """Runs the scripted rollout through `model` and calls `compare(scores, truth, where)` for every token the
    policy sampled: `scores` are the raw scores `generate` sampled it from, `truth` the logits of one unpadded forward
    pass over its context, cast to the scores' dtype. Asserts the structure (which rows called code, that every
    sampled token was compared and each step attended to exactly its context). Returns the rollout result.
    """
    pad = tokenizer.pad_token_id
    device = model.device
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [encode(p) for p in SCRIPTS]
    # Scripted turns first (forced token by token through real forward passes), then the model writes freely.
    turns = {tuple(p[:KEY]): [encode(t) for t in script] for p, script in zip(prompts, SCRIPTS.values())}
    log, calls = [], []
    masks, hook = record_attention_masks(model)
    config = GenerationConfig(max_new_tokens=90, eos_token_id=[tokenizer.eos_token_id], pad_token_id=pad, **sampling)
    backend = TransformersBackend(
        model,
        tokenizer,
        config,
        "</code>",
        [tokenizer.eos_token_id],
        reuse_cache=reuse_cache,
        logits_processor=lambda: LogitsProcessorList(
            [Recorder(log), ForceTurn(turns, len(calls) - 1 if calls.append(1) is None else 0, tokenizer)]
        ),
    )
    spec = RolloutSpec(max_completion_length=90, eos_token_ids=[tokenizer.eos_token_id], max_tool_calls=3)
    torch.manual_seed(seed)
    result = interleaved_rollout(prompts, backend, FakeSandbox(), tokenizer, spec)
    hook.remove()
    assert result.num_tool_calls == [1, 0, 2, 0, 1]
    assert len(result.completion_ids[3]) < len(result.completion_ids[2])  # row D left the batch early

    full = [p + c for p, c in zip(prompts, result.completion_ids)]
    with torch.no_grad():  # the independent truth: one unpadded forward per row
        truth = [model(input_ids=torch.tensor([seq], device=device)).logits[0] for seq in full]
    checked = [set() for _ in prompts]
    assert len(masks) == len(log)
    for (step, ids, scores), mask in zip(log, masks):
        mask = torch.ones_like(ids) if mask is None else mask  # generate drops an all-ones mask
        assert mask.shape == ids.shape
        for b, (row_ids, row_mask) in enumerate(zip(ids.tolist(), mask.tolist())):
            if step > 0 and row_ids[-1] == pad:  # this row stopped earlier in the call; its step samples nothing
                continue
            # (A row's first step after it stopped is still fed its real last token: its scores must match too.)
            seen = [t for t, m in zip(row_ids, row_mask) if m]  # what the model attends to
            r = next(k for k, p in enumerate(prompts) if seen[:KEY] == p[:KEY])
            length = len(seen)
            assert seen == full[r][:length], f"row {r} attended to ids that are not its context"
            assert row_mask[-1] == 1, f"row {r} sampled from a masked position"
            if length == len(full[r]):  # the step right after the row's last token (EOS, budget): nothing kept
                continue
            position = length - len(prompts[r])  # the completion token sampled from these scores
            if not result.interpreter_mask[r][position]:  # the row stopped at the previous step, before a block
                continue
            where = f"row {r}, completion token {position}, step {step}, width {len(row_ids)}"
            compare(scores[b], truth[r][length - 1].to(scores.dtype), where)
            checked[r].add(position)
    for r, mask in enumerate(result.interpreter_mask):  # every sampled token was checked
        assert checked[r] == {i for i, m in enumerate(mask) if m}, f"row {r}: unchecked sampled tokens"
    return result
