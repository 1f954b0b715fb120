"""Small builders for tests and benchmarks: tokenizers and tiny Qwen2 models made locally (no hub), a scripted
generation backend, and an in-process fake sandbox.

Not used by training itself.
"""

from __future__ import annotations

import contextlib
import io
import string
import time
from collections.abc import Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LogitsProcessor, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from .parsing import Tags
from .rollout import RolloutResult
from .types import TurnOutput
from .sandbox import ExecResult

SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]
TAGS = ["<code>", "</code>", "<interpreter>", "</interpreter>"]


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


def make_bpe_tokenizer(corpus: Sequence[str] | None = None, vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained without pre-splitting, so merges cross tag boundaries: the tags are split over
    several tokens, and tokens such as `)</code>` or `</code>\\n` (the tag inside a longer token) exist."""
    corpus = corpus or [
        "Compute it.<code>x = 6 * 7\nprint(x)</code>\n<interpreter>42\n</interpreter>So \\boxed{42}.",
        "Let me check.<code>print(sum(range(10)))</code>\n<interpreter>45\n</interpreter>\\boxed{45}",
        "Try <code>```python\nimport math\nprint(math.factorial(5))\n```</code>\n<interpreter>120\n</interpreter>",
        "The answer is \\boxed{7}. No code needed, héllo wörld ∑ 数学.",
    ] * 50
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    return _wrap(tok)


def make_char_tokenizer(extra_chars: str = "") -> PreTrainedTokenizerFast:
    """A character-level tokenizer with the four ReTool tags as single (non-special) tokens."""
    chars = sorted(set(string.printable) - set("\r\x0b\x0c") | set(extra_chars))
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *TAGS, *chars, "[UNK]"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens(TAGS)
    return _wrap(tok)


def make_tiny_qwen2(tokenizer, hidden_size: int = 32, num_layers: int = 2, seed: int = 0) -> Qwen2ForCausalLM:
    """A randomly initialised Qwen2 small enough for CPU tests (a few thousand parameters per layer)."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return Qwen2ForCausalLM(config)


class ScriptedBackend:
    """A generation backend that "writes" fixed texts, one per sequence, as a real model would emit tokens.

    Each script is tokenized once as a whole (never per turn), then emitted token by token: a turn stops after the
    token that completes the code-end tag (if requested), at the budget, or with EOS after the script's last token.
    `scripts[i]` belongs to the i-th sequence of the first call; later calls (a subset of the sequences, extended by
    interpreter tokens) are matched to their script by the sequence each one had at the end of its previous turn.
    """

    def __init__(self, tokenizer, scripts: Sequence[str], code_end: str = "</code>", step_seconds: float = 0.0):
        self.tokenizer = tokenizer
        self.code_end = code_end
        self.step_seconds = step_seconds
        self.script_ids = [tokenizer(s, add_special_tokens=False)["input_ids"] for s in scripts]
        self.cursor = [0] * len(scripts)
        self.last_sequence: list[list[int] | None] = [None] * len(scripts)
        self.calls: list[int] = []  # batch size of each call

    def _match(self, sequences) -> list[int]:
        if not self.calls:
            if len(sequences) != len(self.script_ids):
                raise ValueError(f"{len(self.script_ids)} scripts for a batch of {len(sequences)} sequences")
            return list(range(len(sequences)))
        taken, rows = set(), []
        for seq in sequences:
            for j, last in enumerate(self.last_sequence):
                if j not in taken and last is not None and list(seq[: len(last)]) == last:
                    taken.add(j)
                    rows.append(j)
                    break
            else:
                raise KeyError("sequence does not continue any scripted sequence")
        return rows

    def generate_turn(self, sequences, max_new_tokens, stop_at_code_end):
        rows = self._match(sequences)
        self.calls.append(len(sequences))
        outputs = []
        for j, seq, budget, stop in zip(rows, sequences, max_new_tokens, stop_at_code_end):
            ids, emitted = self.script_ids[j], []
            while len(emitted) < budget:
                if self.cursor[j] >= len(ids):
                    emitted.append(self.tokenizer.eos_token_id)
                    break
                emitted.append(ids[self.cursor[j]])
                self.cursor[j] += 1
                if stop and self.code_end in self.tokenizer.decode(emitted):
                    break
            if self.step_seconds:
                time.sleep(self.step_seconds * len(emitted))
            self.last_sequence[j] = [*seq, *emitted]
            outputs.append(TurnOutput(emitted, [-0.5] * len(emitted)))
        return outputs


class ScriptForcingProcessor(LogitsProcessor):
    """Makes a real model emit scripted turns through `generate` (every forward pass still runs).

    `turns[key]` lists the token ids of each turn of the sequence whose non-padding ids start with `key` (its
    prompt; all keys have the same length). The turn index is the number of code-end tags already in the sequence,
    so the same turns serve every turn of an interleaved rollout; after a turn's last token it forces EOS; a `None`
    turn is left to the model (for all rows of that call: script every row's turns alike). Use a new
    processor for each `generate` call (it remembers where the call started).
    """

    def __init__(self, turns: dict, tokenizer, code_end: str = "</code>"):
        self.turns, self.tokenizer, self.code_end = turns, tokenizer, code_end
        self.key_len = len(next(iter(turns)))
        self.start_width, self.plan = None, None

    def __call__(self, input_ids, scores):
        if self.start_width is None:
            # First step of a new `generate` call: find each row's script and turn.
            self.start_width, self.plan = input_ids.shape[1], []
            pad = self.tokenizer.pad_token_id
            for row in input_ids.tolist():
                start = next((i for i, t in enumerate(row) if t != pad), len(row))
                key = tuple(row[start : start + self.key_len])
                turn = self.tokenizer.decode(row[start + self.key_len :]).count(self.code_end)
                self.plan.append(self.turns[key][turn])
        step = input_ids.shape[1] - self.start_width
        if all(turn is None for turn in self.plan):  # an unscripted turn: the model decides
            return scores
        eos = self.tokenizer.eos_token_id
        forced = torch.tensor([turn[step] if step < len(turn) else eos for turn in self.plan], device=scores.device)
        # Replace the scores outright: any later warper (top-k, top-p) then still keeps exactly the forced token.
        forced_scores = torch.full_like(scores, float("-inf"))
        forced_scores[torch.arange(len(forced), device=scores.device), forced] = 0.0
        return forced_scores


def script_turns(tokenizer, script: str, code_end: str = "</code>") -> list[list[int]]:
    """The script's token ids (tokenized as a whole) split into turns after each token that completes a code-end
    tag, as a model writing this text would be stopped; the last turn runs to the end."""
    ids = tokenizer(script, add_special_tokens=False)["input_ids"]
    turns, start, seen = [], 0, 0
    for i in range(1, len(ids) + 1):
        count = tokenizer.decode(ids[:i]).count(code_end)
        if count > seen:
            turns.append(ids[start:i])
            start, seen = i, count
    return [*turns, ids[start:]]


class FakeVLLMGeneration:
    """Stands in for TRL's `VLLMGeneration` helper: same `generate` signature and return value, scripted tokens.

    It honours `generation_kwargs["stop"]` and `max_completion_length` as vLLM does. With `overshoot=True` it returns
    one token past the token that completes the stop string (which the backend must cut). The sampling logprob of
    token `t` is `-t / 1000`, so alignment between tokens and logprobs can be checked.
    """

    mode = "colocate"

    def __init__(self, tokenizer, scripts: Sequence[str], overshoot: bool = False):
        self.scripted = ScriptedBackend(tokenizer, scripts)
        self.overshoot = overshoot
        self.max_completion_length = 10_000
        self.generation_kwargs: dict = {}
        self.requests: list[dict] = []

    def sync_weights(self):
        pass

    def generate(self, prompts, images, num_generations, profiler=None):
        assert num_generations == 1 and images is None
        stops = self.generation_kwargs.get("stop") or []
        self.requests.append({"n": len(prompts), "stop": list(stops), "max_tokens": self.max_completion_length})
        scripted = self.scripted
        outputs = scripted.generate_turn(prompts, [self.max_completion_length] * len(prompts), [bool(stops)] * len(prompts))
        completion_ids = []
        for out, seq in zip(outputs, prompts):
            ids = list(out.token_ids)
            if self.overshoot and stops and ids and ids[-1] != scripted.tokenizer.eos_token_id:
                ids.append(ids[-1])  # a token sampled after the stop, which the trainer must not keep
            completion_ids.append(ids)
        logprobs = [[[-t / 1000] for t in ids] for ids in completion_ids]
        return prompts, completion_ids, logprobs, None


class FakeSandbox:
    """In-process sandbox with the `retool_trl.sandbox` interface, for fast rollout tests (no isolation at all)."""

    def __init__(self, outputs: dict[str, str] | None = None):
        self.outputs = outputs or {}  # code -> forced output (else the code is really executed)
        self.batches: list[int] = []
        self.sessions = []

    class _Session:
        def __init__(self, sandbox):
            self.sandbox, self.globals, self.closed = sandbox, {}, False

        def run(self, code: str) -> ExecResult:
            return self.sandbox.run_many([(self, code)])[0]

        def close(self):
            self.closed = True

    def session(self):
        self.sessions.append(self._Session(self))
        return self.sessions[-1]

    def run_many(self, pairs):
        self.batches.append(len(pairs))
        results = []
        for session, code in pairs:
            if code in self.outputs:
                results.append(ExecResult(self.outputs[code], True, False, 0.0))
                continue
            buffer = io.StringIO()
            ok = True
            with contextlib.redirect_stdout(buffer):
                try:
                    exec(code, session.globals)
                except Exception as exc:  # noqa: BLE001 - reported to the model like an interpreter would
                    ok = False
                    buffer.write(f"{type(exc).__name__}: {exc}\n")
            results.append(ExecResult(buffer.getvalue(), ok, False, 0.0))
        return results

    def close(self):
        pass


def save_tiny_model(path, tokenizer, **kwargs) -> str:
    """Saves a `make_tiny_qwen2` model and its tokenizer to `path` (TRL loads the reference model from a path)."""
    model = make_tiny_qwen2(tokenizer, **kwargs)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def assert_rollout_invariants(result: RolloutResult, tokenizer, scripts: Sequence[str], max_len: int) -> None:
    """The interpreter-mask contract (DESIGN §3) for a rollout whose policy wrote `scripts`."""
    tags = Tags()
    for i, script in enumerate(scripts):
        ids, mask = result.completion_ids[i], result.interpreter_mask[i]
        assert len(ids) == len(mask) <= max_len
        assert set(mask) <= {0, 1}
        model_ids = [t for t, m in zip(ids, mask) if m]
        script_ids = tokenizer(script, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        # The policy's tokens are exactly the scripted tokens, in order, none dropped, none re-tokenized.
        assert model_ids == script_ids[: len(model_ids)]
        if len(ids) < max_len:
            assert model_ids == script_ids
            assert tokenizer.decode(model_ids, skip_special_tokens=True) == script
            assert result.model_text[i] == script
        if result.logprobs is not None:
            assert len(result.logprobs[i]) == len(ids)
        # Environment tokens form complete interpreter blocks (except a block cut by the length budget).
        env_text = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
        if len(ids) < max_len:
            assert env_text.count(tags.interpreter_start) == env_text.count(tags.interpreter_end)
            assert env_text.count(tags.interpreter_start) == result.num_tool_calls[i]


def record_rewards(trainer) -> dict:
    """Wraps `trainer._calculate_rewards` so each call's reward matrix is kept under `["rewards"]`."""
    seen = {}
    original = trainer._calculate_rewards

    def recording(*args):
        seen["rewards"] = original(*args)
        return seen["rewards"]

    trainer._calculate_rewards = recording
    return seen
