"""The GPU check: what only a GPU can show, in one command on a machine without network access.

1. The interpreter mask gives exactly zero gradient to interpreter and padding tokens, in fp32 and bf16, for each
   loss type the test suite covers (the test's own machinery, `tests/helpers/testing_utils.py`, on this device).
2. KV-cache reuse across turns is exact: every token the rollout samples comes from the same logits as one full
   forward pass over its context (`tests/helpers/kv_exactness.py`), in fp64 and fp32, with the bf16 gap reported.
3. Three `ReToolTrainer` steps with LoRA, bf16, gradient checkpointing and SDPA on a randomly initialised model of
   Qwen2.5-1.5B's shape (its vocabulary size, a byte-level BPE of as many tokens, Qwen2.5's chat template as TRL
   ships it), transformers backend, the real local sandbox: losses, `retool/*` metrics, peak GPU memory, and each
   step's time split into rollout, sandbox (inside the rollout) and the rest (scoring, loss, backward, optimizer).
   A random model writes no code, so each rollout is forced (`ScriptForcingProcessor`) to write two code cells
   and then continues freely up to `max_completion_length`.
4. Rollout throughput: the interleaved rollout against plain `generate` of as many tokens per row on the same model
   (EOS suppressed), alternated; both rates and the ratio of per-token times.
5. A few `ReToolTrainer` steps in `call_format="tool_call"` on the same model and chat template: the prompt carries
   the `code_interpreter` tool, each rollout is forced to write one tool call as Qwen2.5 writes it, which must be
   read, run and answered by a `tool` message, and then an answer; losses and `retool/*` metrics.

The last line of stdout is one JSON object (also written to `--out`). `--device cpu --shape tiny` runs the same
path end to end on a CPU in a few minutes. Run through `scripts/gpu_check.sh`, which installs the wheels first.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the tests' helpers, reused as they are

import torch  # noqa: E402
from gpu_model import build_model, build_tokenizer  # noqa: E402

SHAPES = {
    # Qwen2.5-1.5B(-Instruct)'s config; 151,643 BPE tokens + 22 added ones, embeddings padded to 151,936 rows.
    "qwen2.5-1.5b": dict(
        bpe_tokens=151_643,
        vocab_size=151_936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32_768,
        batch=16,
        num_generations=8,
        max_completion_length=512,
    ),
    "tiny": dict(
        bpe_tokens=2_048,
        vocab_size=2_176,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4_096,
        batch=4,
        num_generations=4,
        max_completion_length=96,
    ),
}
QUESTION = "What is 1234 * 5678 + 9? Put the final answer in \\boxed{}."
SCRIPT = "I will compute it.<code>x = 1234 * 5678\nprint(x)</code>Now add 9.<code>print(x + 9)</code>"
# The same computation as one Qwen2.5-style tool call (its turn ends with the forced end-of-turn token), then an
# answer.
TOOL_CALL_TURNS = (
    'I will compute it.\n<tool_call>\n{"name": "code_interpreter", "arguments": {"code": "print(1234 * 5678 + 9)"}}'
    "\n</tool_call>",
    "So the answer is \\boxed{7006661}.",
)
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="Where to run.")
    parser.add_argument("--shape", choices=tuple(SHAPES), default=None, help="Model shape (cuda: qwen2.5-1.5b).")
    parser.add_argument("--steps", type=int, default=3, help="ReToolTrainer steps.")
    parser.add_argument("--repeats", type=int, default=2, help="Alternated rollout/generate timings.")
    parser.add_argument("--max-completion-length", type=int, default=None, help="Default: the shape's.")
    parser.add_argument(
        "--skip",
        default="",
        help="Comma-separated sections to skip: mask_gradient,kv_reuse,train,throughput,tool_call.",
    )
    parser.add_argument("--out", default=None, help="Also write the JSON object to this file.")
    args = parser.parse_args()
    args.shape = args.shape or ("qwen2.5-1.5b" if args.device == "cuda" else "tiny")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "gpu_check: --device cuda but torch sees no CUDA device; use --device cpu on a CPU machine\n")
    return args


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------- 1. mask gradient
def check_mask_gradient(device: str, tmp: Path) -> dict:
    """`tests/training/test_trainer.py::test_interpreter_tokens_get_exactly_zero_gradient` on this device and in each
    dtype: the largest per-token |grad| on masked tokens (must be exactly 0) and the share of model tokens with a
    nonzero gradient (must be 1)."""
    from helpers.testing_utils import (
        MASK_LOSS_TYPES,
        TOOL_SCRIPTS,
        FakeSandbox,
        interpreter_token_gradients,
        make_char_tokenizer,
        ramp_reward,
        scripted_trainer,
    )

    tokenizer = make_char_tokenizer()
    report = {}
    for name in ("fp32", "bf16"):
        report[name] = {}
        for loss_type in MASK_LOSS_TYPES:
            trainer = scripted_trainer(
                tmp / f"mask_{name}_{loss_type}",
                tokenizer,
                TOOL_SCRIPTS,
                FakeSandbox(),
                reward_funcs=ramp_reward,
                loss_type=loss_type,
                num_iterations=2,
                beta=0.1,
                use_cpu=device == "cpu",
                bf16=name == "bf16",
                model_init_kwargs={"dtype": DTYPES[name]},
            )
            inputs = trainer._generate_and_score_completions([{"prompt": "Q:", "answer": "42"}] * 4)
            per_token, masked = interpreter_token_gradients(trainer, inputs)
            report[name][loss_type] = {
                "masked_tokens": int(masked.sum()),
                "masked_max_grad": float(per_token[masked].max()) if masked.any() else 0.0,
                "model_tokens_nonzero": float((per_token[~masked] > 0).float().mean()),
                "param_dtype": str(next(trainer.model.parameters()).dtype).removeprefix("torch."),
            }
    report["zero"] = all(
        r["masked_max_grad"] == 0.0 and r["masked_tokens"] > 0 and r["model_tokens_nonzero"] == 1.0
        for name in ("fp32", "bf16")
        for r in report[name].values()
    )
    return report


# ------------------------------------------------------------------------------------------- 2. KV-cache reuse
def check_kv_reuse(device: str) -> dict:
    """`tests/rollout/test_kv_reuse_exact.py` on this device per dtype (greedy and sampled, cache kept and not): the
    largest gap between a sampled token's scores and the full forward's logits, and how many tokens exceed the CPU
    test's tolerance (|gap| <= 1e-6 + 1e-6 |logit|)."""
    from helpers.kv_exactness import check_sampled_logits
    from helpers.testing_utils import make_char_tokenizer, make_tiny_qwen2

    tokenizer = make_char_tokenizer()
    report = {}
    for name, dtype in DTYPES.items():
        seen = {"tokens": 0, "max_abs_gap": 0.0, "over_test_tolerance": 0, "max_abs_logit": 0.0}

        def compare(scores, truth, where, seen=seen):
            gap = (scores.double() - truth.double()).abs()
            seen["tokens"] += 1
            seen["max_abs_gap"] = max(seen["max_abs_gap"], float(gap.max()))
            seen["over_test_tolerance"] += int((gap > 1e-6 + 1e-6 * truth.double().abs()).any())
            seen["max_abs_logit"] = max(seen["max_abs_logit"], float(truth.abs().max()))

        for sampling in (dict(do_sample=False), dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9)):
            for reuse_cache in (True, False):
                model = make_tiny_qwen2(tokenizer, seed=5).to(device=device, dtype=dtype).eval()
                check_sampled_logits(model, tokenizer, sampling, reuse_cache, compare)
        report[name] = seen
    report["fp32_exact"] = report["fp32"]["over_test_tolerance"] == 0
    report["bf16_gap"] = report["bf16"]["max_abs_gap"]
    if device == "cuda":
        report["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
    return report


class Timers:
    """Wall time of each training step, of each rollout and of the sandbox calls inside it."""

    def __init__(self, device: str):
        self.device, self.step, self.rollout, self.sandbox = device, [], [], []
        self._sandbox_now = 0.0

    def wrap_rollout(self, trainer) -> None:
        inner = trainer._generate_rollout

        def timed(prompt_ids):
            self._sandbox_now, start = 0.0, time.perf_counter()
            result = inner(prompt_ids)
            self.rollout.append(time.perf_counter() - start)
            self.sandbox.append(self._sandbox_now)
            return result

        trainer._generate_rollout = timed

    def wrap_sandbox(self, sandbox) -> None:
        inner = sandbox.run_many

        def timed(pairs):
            start = time.perf_counter()
            try:
                return inner(pairs)
            finally:
                self._sandbox_now += time.perf_counter() - start

        sandbox.run_many = timed

    def callback(self):
        from transformers import TrainerCallback

        timers = self

        class StepTimer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                sync(timers.device)
                self.start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                sync(timers.device)
                timers.step.append(time.perf_counter() - self.start)

        return StepTimer()


def make_sandbox(args):
    """The sandbox the config asks for; where it refuses to run as root without bubblewrap (a bare container), the
    check opts in (it runs only its own two cells) and says so."""
    from retool_trl.sandbox import UnsafeSandboxError
    from retool_trl.sandbox.factory import sandbox_from_config

    sandbox = sandbox_from_config(args)
    try:
        return sandbox, sandbox.isolation_report()
    except UnsafeSandboxError as exc:  # reported in the JSON; the check goes on without isolation
        sandbox.close()
        args.sandbox_allow_root_without_isolation = True
        sandbox = sandbox_from_config(args)
        return sandbox, {**sandbox.isolation_report(), "refused_first": str(exc).splitlines()[0][:300]}


# ------------------------------------------------------------------------------------------- 3. training steps
def build_trainer(cli, shape: dict, tmp: Path, call_format: str = "tags"):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import LogitsProcessorList

    from helpers.testing_utils import ramp_reward
    from retool_trl import ReToolConfig, ReToolTrainer
    from retool_trl.data.prompt_ids import tokenize_prompts
    from retool_trl.models.tiny import ScriptForcingProcessor, script_turns
    from retool_trl.rollout.engines.transformers_generate import TransformersBackend

    on_gpu = cli.device == "cuda"
    tokenizer = build_tokenizer(shape["bpe_tokens"])
    model = build_model(tokenizer, shape, cli.device, torch.bfloat16 if on_gpu else torch.float32)
    batch, max_len = shape["batch"], cli.max_completion_length or shape["max_completion_length"]
    args = ReToolConfig(
        output_dir=str(tmp / "train"),
        per_device_train_batch_size=batch,
        num_generations=shape["num_generations"],
        max_completion_length=max_len,
        max_steps=cli.steps,
        learning_rate=1e-5,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        bf16=on_gpu,
        use_cpu=not on_gpu,
        gradient_checkpointing=True,
        beta=0.0,
        seed=0,
        call_format=call_format,
    )
    sandbox, isolation = make_sandbox(args)
    messages = [{"role": "user", "content": QUESTION}]
    trainer = ReToolTrainer(
        model,
        # Distinct rewards within each group: a random model earns no accuracy reward, and the loss needs advantages.
        reward_funcs=ramp_reward,
        args=args,
        train_dataset=Dataset.from_list([{"prompt": messages, "answer": str(1234 * 5678 + 9)}] * batch * cli.steps),
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=16,
            lora_alpha=32,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            task_type="CAUSAL_LM",
        ),
        sandbox=sandbox,
    )
    # Every row has the same prompt (the trainer's own tokenisation of it): force two code cells, then let it write;
    # in `tool_call`, one tool call then the answer (a turn is counted by the tool responses inserted before it).
    prompt_ids = tokenize_prompts(tokenizer, [messages], args)[0]
    if call_format == "tool_call":
        turn_mark = "<tool_response>"
        scripted = [tokenizer(turn, add_special_tokens=False)["input_ids"] for turn in TOOL_CALL_TURNS]
    else:
        turn_mark, scripted = args.code_end, [*script_turns(tokenizer, SCRIPT)[:-1], *[None] * 8]
    turns = {tuple(prompt_ids): scripted}
    trainer._make_generation_backend = lambda unwrapped: TransformersBackend(
        unwrapped,
        tokenizer,
        trainer.generation_config,
        trainer._call_format.stop,
        trainer.eos_token_ids,
        logits_processor=lambda: LogitsProcessorList([ScriptForcingProcessor(turns, tokenizer, turn_mark)]),
    )
    return trainer, tokenizer, sandbox, isolation, messages


def run_training(trainer, timers: Timers, device: str) -> dict:
    timers.wrap_rollout(trainer)
    trainer.add_callback(timers.callback())
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    logs = [e for e in trainer.state.log_history if "loss" in e]
    losses = [e["loss"] for e in logs]
    retool = {k: round(v, 4) for k, v in logs[-1].items() if k.startswith("retool/")} if logs else {}
    steps = len(timers.step)
    report = {
        "steps": steps,
        "losses": losses,  # ~0 by construction at each step's first iteration (advantages sum to zero per group)
        "grad_norms": [e.get("grad_norm") for e in logs],
        "loss_finite": bool(losses) and all(math.isfinite(x) for x in losses),
        "retool_metrics": retool,
        "retool_metrics_present": "retool/code_ratio" in retool and "retool/calls_per_completion" in retool,
        "train_wall_s": round(wall, 2),
        "step_s": [round(x, 3) for x in timers.step],
        "rollout_s": [round(x, 3) for x in timers.rollout[:steps]],
        "sandbox_s": [round(x, 3) for x in timers.sandbox[:steps]],
        "rest_of_step_s": [round(s - r, 3) for s, r in zip(timers.step, timers.rollout)],
        "params_m": round(sum(p.numel() for p in trainer.model.parameters()) / 1e6, 1),
        "trainable_params_m": round(sum(p.numel() for p in trainer.model.parameters() if p.requires_grad) / 1e6, 2),
    }
    if device == "cuda":
        report["peak_gpu_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        report["peak_gpu_reserved_gb"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    return report


# ------------------------------------------------------------------------------------------- 5. tool calls
def run_tool_call(cli, shape: dict, tmp: Path) -> dict:
    """A few steps in `call_format="tool_call"`: every completion's forced call is read, runs without error, and
    its answer comes back as a tool message before the model answers."""
    cli = copy.copy(cli)  # room for the call (one token per character with the tiny shape's merges) and its answer
    cli.max_completion_length = max(cli.max_completion_length or shape["max_completion_length"], 256)
    trainer, _, sandbox, _, _ = build_trainer(cli, shape, tmp / "tool_call", call_format="tool_call")
    try:
        report = run_training(trainer, Timers(cli.device), cli.device)
    finally:
        sandbox.close()
    metrics = report["retool_metrics"]
    report["calls_read"] = (
        report["loss_finite"]
        and metrics.get("retool/code_ratio") == 1.0
        and metrics.get("retool/calls_per_completion") == 1.0
        and metrics.get("retool/error_rate") == 0.0
    )
    return report


# ------------------------------------------------------------------------------------------- 4. throughput
def run_throughput(trainer, tokenizer, messages, shape: dict, cli, timers: Timers) -> dict:
    """The rollout (`trainer._generate`, as a training step calls it) against plain `generate` of as many tokens per
    row, through the same unwrapped model and generation config; alternated `--repeats` times, medians."""
    from trl.models.utils import unwrap_model_for_generation

    prompts = [messages] * shape["batch"]
    prompt_ids = trainer._tokenize_prompts(trainer._with_system_prompt(prompts[:1]))[0][0]
    input_ids = torch.tensor([prompt_ids] * len(prompts), device=trainer.accelerator.device)
    rollout, plain = [], []
    for _ in range(cli.repeats):
        sync(cli.device)
        start = time.perf_counter()
        _, completion_ids, tool_mask, *_ = trainer._generate(prompts)
        sync(cli.device)
        rollout.append((time.perf_counter() - start, sum(map(len, completion_ids)), sum(map(sum, tool_mask))))
        # The same settings as the rollout's `generate` calls (KV cache on), EOS suppressed for `length` tokens.
        config = copy.copy(trainer.generation_config)
        config.max_new_tokens = config.min_new_tokens = max(map(len, completion_ids))
        config.use_cache, config.pad_token_id = True, tokenizer.pad_token_id
        with (
            torch.no_grad(),
            unwrap_model_for_generation(
                trainer.model_wrapped,
                trainer.accelerator,
                generation_kwargs=trainer.generation_kwargs,
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
            ) as model,
        ):
            sync(cli.device)
            start = time.perf_counter()
            out = model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
            sync(cli.device)
            plain.append((time.perf_counter() - start, (out.shape[1] - input_ids.shape[1]) * out.shape[0]))
    rollout_rate = statistics.median(tokens / s for s, tokens, _ in rollout)
    plain_rate = statistics.median(tokens / s for s, tokens in plain)
    return {
        "batch": len(prompts),
        "rollout_tokens": [t for _, t, _ in rollout],
        "rollout_sampled_tokens": [m for _, _, m in rollout],
        "rollout_s": [round(s, 3) for s, _, _ in rollout],
        "plain_tokens": [t for _, t in plain],
        "plain_s": [round(s, 3) for s, _ in plain],
        "rollout_tokens_per_s": round(rollout_rate, 1),  # all completion tokens, interpreter tokens included
        "rollout_sampled_tokens_per_s": round(statistics.median(m / s for s, _, m in rollout), 1),
        "plain_generate_tokens_per_s": round(plain_rate, 1),
        "rollout_vs_generate": round(plain_rate / rollout_rate, 3),  # per-token time, rollout over plain
        "sandbox_s": [round(x, 3) for x in timers.sandbox[-cli.repeats :]],
    }


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for name in ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "retool-trl"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    import retool_trl

    found["retool_trl_from"] = str(Path(retool_trl.__file__).parent)
    return found


def main() -> None:
    cli = parse_args()
    skip = set(filter(None, cli.skip.split(",")))
    shape = SHAPES[cli.shape]
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    started = time.perf_counter()
    result = {
        "device": torch.cuda.get_device_name(0) if cli.device == "cuda" else f"cpu ({platform.processor() or 'x86'})",
        "shape": cli.shape,
        "versions": versions(),
        "errors": {},
    }
    if cli.device == "cuda":
        result["cuda"] = torch.version.cuda

    def section(name, fn, *fn_args):
        if name in skip:
            return None
        print(f"gpu_check: {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            result[name] = fn(*fn_args)
        except Exception as exc:  # noqa: BLE001 - one failing section must not hide the others' numbers
            traceback.print_exc()
            result["errors"][name] = f"{type(exc).__name__}: {str(exc)[:500]}"
        print(f"gpu_check: {name} done in {time.perf_counter() - t0:.1f} s", flush=True)
        if cli.out:  # what is measured so far, in case the machine's time runs out before the end
            write(cli.out, {**result, "partial": True})
        return result.get(name)

    section("mask_gradient", check_mask_gradient, cli.device, tmp)
    section("kv_reuse", check_kv_reuse, cli.device)
    if not {"train", "throughput"} <= skip:
        sandbox = None
        try:
            timers = Timers(cli.device)
            trainer, tokenizer, sandbox, isolation, messages = build_trainer(cli, shape, tmp)
            result["sandbox_isolation"] = isolation
            timers.wrap_sandbox(sandbox)
            section("train", run_training, trainer, timers, cli.device)
            section("throughput", run_throughput, trainer, tokenizer, messages, shape, cli, timers)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            result["errors"]["build"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        finally:
            if sandbox is not None:
                sandbox.close()
    if "tool_call" not in skip:
        section("tool_call", run_tool_call, cli, shape, tmp)

    train, kv, mask = result.get("train") or {}, result.get("kv_reuse") or {}, result.get("mask_gradient") or {}
    result["ok"] = not result["errors"] and all(
        [
            mask.get("zero", "mask_gradient" in skip),
            kv.get("fp32_exact", "kv_reuse" in skip),
            train.get("loss_finite", "train" in skip) and train.get("retool_metrics_present", "train" in skip),
            (result.get("tool_call") or {}).get("calls_read", "tool_call" in skip),
        ]
    )
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if cli.out:
        write(cli.out, result)
    print(json.dumps(result), flush=True)


def write(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
