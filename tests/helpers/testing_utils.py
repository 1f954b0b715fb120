"""Test support (as TRL keeps its own in a `testing_utils` module): tokenizers and tiny models, fakes of TRL's vLLM
helper, and the assertions several test files share. Not part of the package."""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from retool_trl.format.prompts import Tags
from retool_trl.models.tiny import (
    EOS_TOKEN,
    PAD_TOKEN,
    ScriptForcingProcessor,
    build_char_tokenizer,
    build_tiny_model,
    save_tiny_model,
    script_turns,
)
from retool_trl.rollout import RolloutResult
from retool_trl.testing import FakeSandbox, ScriptedBackend

__all__ = [
    "MASK_LOSS_TYPES",
    "PROBLEMS_ARGS",
    "TOOL_SCRIPTS",
    "FakeSandbox",
    "FakeVLLMGeneration",
    "ScriptForcingProcessor",
    "ScriptedBackend",
    "assert_rollout_invariants",
    "interpreter_token_gradients",
    "make_bpe_tokenizer",
    "make_char_tokenizer",
    "make_closed_vocab_tokenizer",
    "make_tiny_qwen2",
    "most_at_once",
    "ramp_reward",
    "record_rewards",
    "reply_json",
    "save_tiny_model",
    "trl_server_generation",
    "script_turns",
    "trainer_for",
    "write_problems",
]


# Completions with code calls, an error and none at all: every kind of interpreter span the mask must cover.
TOOL_SCRIPTS = [
    "First <code>x = 6 * 7\nprint(x)</code> so \\boxed{42}",
    "Guess \\boxed{41}",
    "Check <code>print(x)</code> then <code>print(40 + 2)</code> \\boxed{42}",
    "Maybe <code>1/0</code> hmm \\boxed{0}",
]


# TRL loss types whose interpreter-token gradient is checked (tests/training/test_trainer.py,
# scripts/gpu/gpu_check.py).
MASK_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")


# The command-line arguments that read a `write_problems` file: its two columns, plain prompts, no system prompt.
PROBLEMS_ARGS = (
    *("--prompt_column", "question", "--answer_column", "final"),
    *("--prompt_format", "plain", "--system_prompt", "none"),
)


def write_problems(path: Path, n: int = 8) -> None:
    """`n` problems "What is i+i?" with their answers, as JSON lines in the columns `PROBLEMS_ARGS` names."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"question": f"What is {i}+{i}?\n", "final": str(2 * i)}) + "\n")


def ramp_reward(completions, **kwargs):
    """Distinct rewards within the group, so advantages (and the policy gradient) are non-zero."""
    return [float(i) for i in range(len(completions))]


def make_bpe_tokenizer(corpus: Sequence[str] | None = None, vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained without pre-splitting, so merges cross tag boundaries: the tags are split over
    several tokens, and tokens such as `)</code>` or `</code>\\n` (the tag inside a longer token) exist."""
    corpus = (
        corpus
        or [
            "Compute it.<code>x = 6 * 7\nprint(x)</code>\n<interpreter>42\n</interpreter>So \\boxed{42}.",
            "Let me check.<code>print(sum(range(10)))</code>\n<interpreter>45\n</interpreter>\\boxed{45}",
            "Try <code>```python\nimport math\nprint(math.factorial(5))\n```</code>\n<interpreter>120\n</interpreter>",
            "The answer is \\boxed{7}. No code needed, héllo wörld ∑ 数学.",
        ]
        * 50
    )
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


def make_char_tokenizer(extra_chars: str = ""):
    """The package's character-level tokenizer ([`~retool_trl.models.tiny.build_char_tokenizer`]): byte-level, so every
    character (`extra_chars` included) is representable."""
    return build_char_tokenizer()


def make_closed_vocab_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer that cannot write everything, for the checks that must refuse one: one token per printable ASCII
    character (anything else is `[UNK]`), the four tags as single tokens. Loaded as `Qwen2Tokenizer` (whose
    pre-tokenizer expects byte-level symbols) it also loses whitespace."""
    tags = list(vars(Tags()).values())
    chars = sorted(set(string.printable) - set("\r\x0b\x0c"))
    vocab = {t: i for i, t in enumerate([EOS_TOKEN, PAD_TOKEN, *tags, *chars, "[UNK]"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([EOS_TOKEN, PAD_TOKEN])
    tok.add_tokens(tags)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN)


def make_tiny_qwen2(tokenizer, hidden_size: int = 32, num_layers: int = 2, seed: int = 0):
    """The package's tiny Qwen2 at its smallest: fast enough for every CPU test."""
    return build_tiny_model(
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=1024,
        seed=seed,
    )


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
        outputs = scripted.generate_turn(
            prompts, [self.max_completion_length] * len(prompts), [bool(stops)] * len(prompts)
        )
        completion_ids = []
        for out in outputs:
            ids = list(out.token_ids)
            if self.overshoot and stops and ids and ids[-1] != scripted.tokenizer.eos_token_id:
                ids.append(ids[-1])  # a token sampled after the stop, which the trainer must not keep
            completion_ids.append(ids)
        logprobs = [[[-t / 1000] for t in ids] for ids in completion_ids]
        return prompts, completion_ids, logprobs, None


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


def trainer_for(tmp_path, scripts, sandbox=None, reward_funcs=None, dataset=None, tokenizer=None, **overrides):
    """A `ReToolTrainer` on a tiny CPU model whose rollouts are `scripts` (a `ScriptedBackend`), ready for
    `_generate_and_score_completions` (model in train mode, one accumulation step).

    Args:
        tmp_path: Folder of the model and the run.
        scripts: The completions the scripted backend writes.
        sandbox: The interpreter; a `FakeSandbox` by default.
        reward_funcs: The trainer's reward functions; its default (`boxed_accuracy`) when `None`.
        dataset: Training rows; four `{"prompt": "Q:", "answer": "42"}` by default.
        tokenizer: The model's tokenizer; the character-level one by default.
        overrides: `ReToolConfig` fields over the defaults (batch 4, 4 generations, 96 tokens, no KL, seed 0).
    """
    from datasets import Dataset

    from retool_trl import ReToolConfig, ReToolTrainer

    tokenizer = tokenizer or make_char_tokenizer()
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=96,
        report_to="none",
        bf16=False,
        use_cpu=True,
        beta=0.0,
        seed=0,
    )
    values.update(overrides)
    trainer = ReToolTrainer(
        save_tiny_model(tmp_path / "m", tokenizer),
        reward_funcs=reward_funcs,
        args=ReToolConfig(**values),
        train_dataset=dataset or Dataset.from_list([{"prompt": "Q:", "answer": "42"}] * 4),
        processing_class=tokenizer,
        sandbox=sandbox or FakeSandbox(),
    )
    trainer._make_generation_backend = lambda model: ScriptedBackend(tokenizer, scripts)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def interpreter_token_gradients(trainer, inputs) -> tuple:
    """Runs `trainer.compute_loss` on a scored batch and backpropagates; returns, per completion token, the summed
    |gradient| at the final hidden state that predicts it, and the boolean mask of tokens that must get none
    (interpreter tokens and padding: `tool_mask * completion_mask == 0`).

    The gradient is taken w.r.t. the final hidden states: after the last norm there is no attention, so the gradient
    at position t is exactly the loss contribution of the token predicted there (TRL fuses the LM head, so logits
    are never materialised and cannot be hooked). Used by the CPU test and by `scripts/gpu/gpu_check.py` on CUDA.
    """
    grads = []

    def hook(module, args, output):  # returns None: the forward output stays as it is
        output.register_hook(grads.append)

    base = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    handle = base.model.norm.register_forward_hook(hook)
    try:
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
    finally:
        handle.remove()
    prompt_len, completion_len = inputs["prompt_ids"].shape[1], inputs["completion_ids"].shape[1]
    # The hidden state at position t predicts token t + 1: completion token j is scored at prompt_len + j - 1.
    grad = grads[0][:, prompt_len - 1 : prompt_len + completion_len - 1, :]
    masked = (inputs["tool_mask"] * inputs["completion_mask"]) == 0
    return grad.float().abs().sum(dim=-1), masked


def most_at_once(spans, slack_s: float = 0.0) -> int:
    """The largest number of (start, end) spans that overlap at one moment, each trimmed by `slack_s` at both ends
    (a cell's own clock reads are not its admission and settling); the sandbox admission tests count with it."""
    edges = sorted([(a + slack_s, 1) for a, b in spans] + [(b - slack_s, -1) for a, b in spans])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def reply_json(handler, status: int, body) -> None:
    """Answers an `http.server` request with `body` as JSON (the replies of the tests' stand-ins for vLLM's server)."""
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def trl_server_generation(accelerator, client, generation_kwargs=None, max_completion_length: int = 50):
    """TRL's own `VLLMGeneration` in server mode, built without its `__init__` (which connects and checks the
    server): its `generate` runs as TRL wrote it, against `client` (TRL's `VLLMClient` or a stand-in)."""
    from trl.generation import vllm_generation as trl_vllm

    helper = object.__new__(trl_vllm.VLLMGeneration)
    helper.__dict__.update(
        mode="server",
        accelerator=accelerator,
        vllm_client=client,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        max_completion_length=max_completion_length,
        logprobs=0,
        structured_outputs_regex=None,
        generation_kwargs=dict(generation_kwargs or {}),
        enable_sleep_mode=False,
    )
    return helper
