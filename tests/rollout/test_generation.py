"""The transformers turn backend: stop at the code-end tag (also inside a longer token), at EOS, or at the budget."""

import torch
from transformers import GenerationConfig

from helpers.testing_utils import make_bpe_tokenizer, make_tiny_qwen2
from retool_trl.rollout.engines.transformers_generate import TransformersBackend, _TurnStopper


def test_stopper_records_where_each_sequence_stops():
    tokenizer = make_bpe_tokenizer(vocab_size=400)
    vocab = tokenizer.get_vocab()
    # A single token that contains the whole tag plus trailing text, e.g. ")</code>\n<interpreter>".
    long_token = next(
        t
        for t in vocab
        if "</code>" in tokenizer.convert_tokens_to_string([t])
        and len(tokenizer.convert_tokens_to_string([t])) > len("</code>")
    )
    plain = tokenizer("abc", add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    from transformers import StopStringCriteria

    criterion = StopStringCriteria(tokenizer=tokenizer, stop_strings=["</code>"])
    rows = [
        plain + [vocab[long_token]],  # tag inside a longer token: stop at step 4
        plain + [eos],  # EOS at step 4
        plain + [vocab[long_token]],  # tag, but stopping at code-end is disabled for this row
        plain + plain[:1],  # budget of 2 tokens
    ]
    stopper = _TurnStopper(criterion, 0, [10, 10, 10, 2], [True, True, False, True], [eos], "cpu")
    for step in range(1, 5):
        stopper(torch.tensor([r[:step] for r in rows]), None)
    assert stopper.stop_len.tolist() == [4, 4, -1, 2]


def test_backend_respects_per_sequence_budgets():
    tokenizer = make_bpe_tokenizer(vocab_size=300)
    model = make_tiny_qwen2(tokenizer).eval()
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        max_new_tokens=50,
        eos_token_id=[tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
    )
    backend = TransformersBackend(model, tokenizer, config, "</code>", [tokenizer.eos_token_id])
    torch.manual_seed(0)
    outs = backend.generate_turn([[5, 6, 7], [8, 9], [10]], [1, 7, 20], [True, True, False])
    assert len(outs[0].token_ids) == 1
    assert len(outs[1].token_ids) <= 7 and len(outs[2].token_ids) <= 20
    for out in outs:  # a sequence only ends early at EOS or right after the tag
        if out.token_ids and out.token_ids[-1] != tokenizer.eos_token_id:
            text = tokenizer.decode(out.token_ids)
            assert len(out.token_ids) in (1, 7, 20) or text.endswith("</code>") or "</code>" in text


def test_real_generate_rollout_with_forced_scripts():
    """The full transformers path (real forward passes, HF stopping criteria) on scripted outputs."""
    from transformers import LogitsProcessorList

    from helpers.testing_utils import FakeSandbox, ScriptForcingProcessor, assert_rollout_invariants, script_turns
    from retool_trl.rollout import RolloutSpec, interleaved_rollout

    tokenizer = make_bpe_tokenizer(vocab_size=400)  # tags inside longer tokens
    scripts = ["Compute.<code>x = 6 * 7\nprint(x)</code>\nSo \\boxed{42}.", "The answer is \\boxed{7}."]
    prompts = [
        tokenizer("Q1:", add_special_tokens=False)["input_ids"],
        tokenizer("Q2:", add_special_tokens=False)["input_ids"],
    ]
    assert len(prompts[0]) == len(prompts[1])
    turns = {tuple(p): script_turns(tokenizer, s) for p, s in zip(prompts, scripts)}
    model = make_tiny_qwen2(tokenizer).eval()
    config = GenerationConfig(
        do_sample=True, max_new_tokens=200, eos_token_id=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id
    )
    backend = TransformersBackend(
        model,
        tokenizer,
        config,
        "</code>",
        [tokenizer.eos_token_id],
        logits_processor=lambda: LogitsProcessorList([ScriptForcingProcessor(turns, tokenizer)]),
    )
    spec = RolloutSpec(max_completion_length=200, eos_token_ids=[tokenizer.eos_token_id])
    result = interleaved_rollout(prompts, backend, FakeSandbox(), tokenizer, spec)
    assert result.num_tool_calls == [1, 0]
    env = tokenizer.decode([t for t, m in zip(result.completion_ids[0], result.interpreter_mask[0]) if not m])
    assert env == "<interpreter>42\n</interpreter>"
    # The first turn's last token holds the tag plus what follows it in the same token.
    first_turn = script_turns(tokenizer, scripts[0])[0]
    assert result.completion_ids[0][: len(first_turn)] == first_turn
    assert_rollout_invariants(result, tokenizer, scripts, 200)


def test_kv_cache_reuse_across_turns_matches_fresh_prefill():
    """Continuing from the kept cache (finished rows dropped, interpreter tokens of different lengths spliced in
    after a masked hole) must score every later token exactly as prefilling the whole sequence again does."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from helpers.testing_utils import FakeSandbox, ScriptForcingProcessor, make_char_tokenizer, script_turns
    from retool_trl.rollout import RolloutSpec, interleaved_rollout

    class Recorder(LogitsProcessor):
        def __init__(self, log):
            self.log = log

        def __call__(self, input_ids, scores):
            self.log.append(scores.clone())
            return scores

    tokenizer = make_char_tokenizer()
    scripts = ["<code>print(7)</code>", "<code>print('x' * 23)</code>", "no code at all", "<code>print(12345)</code>"]
    prompts = [tokenizer(f"P{i}:", add_special_tokens=False)["input_ids"] for i in range(len(scripts))]
    # First turn scripted (so that three rows call code), the next one left to the model.
    turns = {tuple(p): [*script_turns(tokenizer, s)[:1], None] for p, s in zip(prompts, scripts)}
    model = make_tiny_qwen2(tokenizer, seed=3).double().eval()
    config = GenerationConfig(
        do_sample=False, max_new_tokens=60, eos_token_id=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id
    )
    results, logs = [], []
    for reuse in (True, False):
        log = []
        backend = TransformersBackend(
            model,
            tokenizer,
            config,
            "</code>",
            [tokenizer.eos_token_id],
            reuse_cache=reuse,
            logits_processor=lambda log=log: LogitsProcessorList(
                [Recorder(log), ScriptForcingProcessor(turns, tokenizer)]
            ),
        )
        spec = RolloutSpec(max_completion_length=60, eos_token_ids=[tokenizer.eos_token_id], max_tool_calls=1)
        results.append(interleaved_rollout(prompts, backend, FakeSandbox(), tokenizer, spec))
        logs.append(log)
        assert backend._cache is None  # released at the end of the rollout
    reused, fresh = results
    assert reused.num_tool_calls == [1, 1, 0, 1]
    assert reused.completion_ids == fresh.completion_ids
    assert len(logs[0]) == len(logs[1]) > 20
    for a, b in zip(logs[0], logs[1]):  # every step of both turns, the model's own scores
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
