"""Every token the transformers backend samples comes from the policy's logits for exactly its context.

The truth is one plain forward pass of the model over `prompt + completion` (no padding, no cache): its logits at
position `t` are what sampling token `t + 1` should have used. Each step of every `generate` call is recorded (the raw
scores, before any warper) and compared with that forward, over the cases that exercise the kept KV cache: stray
code-end tags and `<code lang=..>` (turns that add no interpreter tokens), rows dropped mid-batch, interpreter blocks
of different lengths, prompts of different lengths (left padding), and greedy and sampled decoding.
"""

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from retool_trl.generation import TransformersBackend
from retool_trl.rollout import RolloutSpec, interleaved_rollout
from retool_trl.testing import FakeSandbox
from testing_utils import make_char_tokenizer, make_tiny_qwen2

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


@pytest.mark.parametrize(
    "sampling",
    [dict(do_sample=False), dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)],
    ids=["greedy", "sampled"],
)
@pytest.mark.parametrize("reuse_cache", [True, False], ids=["reuse", "no-reuse"])
def test_every_sampled_token_matches_a_full_forward(sampling, reuse_cache):
    tokenizer = make_char_tokenizer()
    pad = tokenizer.pad_token_id
    model = make_tiny_qwen2(tokenizer, seed=5).double().eval()
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
    torch.manual_seed(0)
    result = interleaved_rollout(prompts, backend, FakeSandbox(), tokenizer, spec)
    hook.remove()
    assert result.num_tool_calls == [1, 0, 2, 0, 1]
    assert len(result.completion_ids[3]) < len(result.completion_ids[2])  # row D left the batch early

    full = [p + c for p, c in zip(prompts, result.completion_ids)]
    with torch.no_grad():  # the independent truth: one unpadded forward per row (float64; generate casts to fp32)
        truth = [model(input_ids=torch.tensor([seq])).logits[0] for seq in full]
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
            torch.testing.assert_close(
                scores[b],
                truth[r][length - 1].to(scores.dtype),
                rtol=1e-6,
                atol=1e-6,
                msg=lambda m, where=where: f"{where}: {m}",
            )
            checked[r].add(position)
    for r, mask in enumerate(result.interpreter_mask):  # every sampled token was checked
        assert checked[r] == {i for i, m in enumerate(mask) if m}, f"row {r}: unchecked sampled tokens"
