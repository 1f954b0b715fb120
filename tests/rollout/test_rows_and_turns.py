"""How the rollout's rows take their turns: a process with no active rows left keeps turning with the others."""

from helpers.testing_utils import (
    FakeSandbox,
    ScriptedBackend,
    make_bpe_tokenizer,
    make_char_tokenizer,
)
from retool_trl.rollout.batched import RolloutSpec, interleaved_rollout
from retool_trl.rollout.types import TurnOutput

BPE = make_bpe_tokenizer()  # byte-level: any text the sandbox prints can be encoded and decoded back


CHAR = make_char_tokenizer()


def run(scripts, tokenizer=BPE, sandbox=None, backend=None, **spec):
    prompts = [tokenizer("Q:", add_special_tokens=False)["input_ids"] for _ in scripts]
    spec = RolloutSpec(max_completion_length=400, eos_token_ids=[tokenizer.eos_token_id], **spec)
    backend = backend or ScriptedBackend(tokenizer, scripts)
    return interleaved_rollout(prompts, backend, sandbox or FakeSandbox(), tokenizer, spec)


# ------------------------------------------------------------------- empty batches, output that is not text
class OldTransformersTokenizer:
    """A tokenizer as transformers 5.19 behaves: `batch_decode([])` returns `[""]`; encoding `[]` is refused."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def batch_decode(self, ids, **kwargs):
        return self._tokenizer.batch_decode(ids, **kwargs) if ids else [""]

    def __call__(self, text, **kwargs):
        assert not isinstance(text, list) or text, "the tokenizer was called on an empty batch"
        return self._tokenizer(text, **kwargs)


class OtherRankStillBusy(ScriptedBackend):
    """This process runs out of rows first; another one keeps the collective loop going for `extra` more turns."""

    extra = 2

    def any_active(self, has_active: bool) -> bool:
        if has_active:
            return True
        self.extra -= 1
        return self.extra >= 0

    def generate_turn(self, sequences, max_new_tokens, stop_at_code_end):
        return super().generate_turn(sequences, max_new_tokens, stop_at_code_end) if sequences else []


def test_a_process_without_active_rows_keeps_turning():
    tokenizer = OldTransformersTokenizer(CHAR)
    scripts = ["<code>print(1)</code>\\boxed{1}", "\\boxed{2}"]
    result = run(scripts, tokenizer=tokenizer, backend=OtherRankStillBusy(CHAR, scripts))
    assert result.num_tool_calls == [1, 0]
    assert result.model_text == scripts
    empty = run([], tokenizer=tokenizer, backend=OtherRankStillBusy(CHAR, []))  # no rows at all on this process
    assert empty.completion_ids == [] and empty.model_text == []


TOKENIZER = make_char_tokenizer()


def test_empty_first_turn_gives_a_completion_trl_can_read():
    class Silent:
        def generate_turn(self, sequences, max_new_tokens, stop_at_code_end):
            return [TurnOutput([]) for _ in sequences]

    spec = RolloutSpec(max_completion_length=10, eos_token_ids=[TOKENIZER.eos_token_id])
    result = interleaved_rollout([[5, 6]], Silent(), FakeSandbox(), TOKENIZER, spec)
    assert result.completion_ids == [[TOKENIZER.eos_token_id]] and result.interpreter_mask == [[0]]
