"""Rollout speed, measured side by side in one run (ratios, not absolute times: this machine is noisy).

Same locally built Qwen2 (~4.7M parameters, fixed seed), same prompts, same tokens: every generator below is
forced (`ScriptForcingProcessor`) to emit the same scripted completions, so each one runs the real forward passes
for exactly the same number of tokens and the number of code calls is known.

1. plain TRL `GRPOTrainer` generation of the full completions (no tools): the floor;
2. `ReToolTrainer`'s interleaved rollout with real code execution in the local sandbox (2 calls per completion);
3. a seed-style loop: per sample, one forward per token with a KV cache, in Python;
4. TRL's native `tools=` loop: not run, see `NATIVE_TOOLS_NOTE`.
Plus a step benchmark: `ReToolTrainer` vs `GRPOTrainer` training steps on the same no-code completions.

    python scripts/bench_rollout.py [--batch 32] [--repeats 3] [--json]

With `--backend vllm` (in `.venv-engines/`, see `scripts/test_engines.sh`): the shipped quickstart model through a
real colocated vLLM engine (CPU build), greedy, the batch sized as one training step's generation batch (every row in
the engine's batch at once). Both rollout modes (async, the default, and barrier) make the same tokens; plain vLLM
generate then makes exactly as many tokens per row (`max_tokens` per row, EOS ignored) in one call, all alternated.
Prints `vllm_rollout_vs_generate` (the default mode) and `vllm_barrier_vs_generate`, and vLLM's own account of
each: engine steps, sequences per step, prefill steps and tokens, time outside the engine's steps.

    .venv-engines/bin/python scripts/bench_rollout.py --backend vllm [--batch 32] [--repeats 3] [--json]
        [--kv-block-size 32] [--separate-cores]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import results_log  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import LogitsProcessorList  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from retool_trl import ReToolConfig, ReToolTrainer  # noqa: E402
from retool_trl.format.parsing import format_interpreter_block  # noqa: E402
from retool_trl.models.tiny import (  # noqa: E402
    ScriptForcingProcessor,
    build_char_tokenizer,
    build_tiny_model,
    script_turns,
)
from retool_trl.sandbox import LocalSandbox  # noqa: E402

NATIVE_TOOLS_NOTE = (
    "TRL's native tools= loop is not measured: it needs a chat template with tool-call rendering and response "
    "parsing (tool schemas, JSON tool calls), which the benchmark's character-level model has no way to produce; "
    "it also re-tokenizes per tool turn (trl#5144), so its token counts would differ from the other rows."
)


def workload(batch: int):
    """Distinct equal-length prompts and scripts with two code calls each; the full texts include the output."""
    prompts, scripts, full_texts = [], [], []
    for i in range(batch):
        a, b, c = 1000 + 37 * i, 200 + 11 * i, 10 + i  # fixed digit counts: equal-length prompts
        code1, code2 = f"x = {a} * {b}\nprint(x)", f"print(x + {c})"
        script = f"Compute.<code>{code1}</code>Add {c}.<code>{code2}</code>So \\boxed{{{a * b + c}}}."
        full = script.replace("</code>Add", "</code>" + format_interpreter_block(f"{a * b}\n") + "Add", 1)
        full = full.replace("</code>So", "</code>" + format_interpreter_block(f"{a * b + c}\n") + "So", 1)
        prompts.append(f"Q{i:03d}: what is {a}*{b}+{c}?")
        scripts.append(script)
        full_texts.append(full)
    return prompts, scripts, full_texts


def forcing(model, turns, tokenizer):
    """Patches `model.generate` so every call is forced to the scripted turns (fresh processor per call)."""
    original = model.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        kwargs["logits_processor"] = LogitsProcessorList([ScriptForcingProcessor(turns, tokenizer)])
        return original(*args, **kwargs)

    model.generate = generate
    return model


def common_args(out, batch, max_len):
    return dict(
        output_dir=out,
        per_device_train_batch_size=batch,
        num_generations=8,
        max_completion_length=max_len,
        report_to="none",
        bf16=False,
        use_cpu=True,
        beta=0.0,
        logging_steps=1000,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )


def median_time(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def seed_loop(model, tokenizer, prompt_ids, scripts_ids, sandbox):
    """One sequence at a time, one forward per token with a KV cache, code run when `</code>` appears."""
    code_end_id = tokenizer.convert_tokens_to_ids("</code>")
    total = 0
    with torch.no_grad():
        for prompt, turns in zip(prompt_ids, scripts_ids):
            session = sandbox.session()
            out = model(torch.tensor([prompt]), use_cache=True)
            past, written, calls = out.past_key_values, [], 0
            for turn in turns:
                for token in [*turn, tokenizer.eos_token_id][: len(turn) + (turn is turns[-1])]:
                    logits = out.logits[:, -1, :]
                    forced = torch.full_like(logits, float("-inf"))
                    forced[0, token] = 0.0
                    token = int(torch.argmax(logits + forced))
                    written.append(token)
                    out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
                    past = out.past_key_values
                    if token == code_end_id:
                        text = tokenizer.decode(written)
                        code = text[text.rfind("<code>") + len("<code>") : text.rfind("</code>")]
                        result = session.run(code)
                        calls += 1
                        ids = tokenizer(format_interpreter_block(result.output), add_special_tokens=False)["input_ids"]
                        out = model(torch.tensor([ids]), past_key_values=past, use_cache=True)
                        past = out.past_key_values
                        written.extend(ids)
            total += len(written)
            session.close()
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="training steps per trainer in the step benchmark")
    parser.add_argument("--json", action="store_true", help="also print one JSON object as the last line")
    parser.add_argument(
        "--backend",
        choices=("transformers", "vllm"),
        default="transformers",
        help="vllm: the rollout through a real vLLM engine against vLLM's plain generate",
    )
    parser.add_argument(
        "--kv-block-size",
        type=int,
        default=None,
        help="with --backend vllm: the engine's KV block size in tokens (default: the build's own, 128 on CPU; GPU "
        "builds use 16); the prefix cache serves a continued turn in whole blocks",
    )
    parser.add_argument(
        "--separate-cores",
        action="store_true",
        help="with --backend vllm: the engine on one core (one thread), the sandbox on the others, as on a GPU node "
        "where the forward does not run on the cores the sandbox uses",
    )
    results_log.add_arguments(parser)
    args = parser.parse_args()
    args.run = results_log.conditions()
    if args.backend == "vllm":
        from bench_vllm_rollout import bench_vllm

        return bench_vllm(args)
    torch.set_num_threads(1)  # the sandbox workers get the other core

    tokenizer = build_char_tokenizer(model_max_length=1024)
    prompts, scripts, full_texts = workload(args.batch)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    tool_turns = {tuple(p): script_turns(tokenizer, s) for p, s in zip(prompt_ids, scripts)}
    plain_turns = {
        tuple(p): [tokenizer(t, add_special_tokens=False)["input_ids"]] for p, t in zip(prompt_ids, full_texts)
    }
    tokens_per_completion = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in full_texts]
    max_len = max(tokens_per_completion) + 8

    tmp = tempfile.mkdtemp(prefix="bench_rollout_")
    model_dir = os.path.join(tmp, "model")
    model = build_tiny_model(
        tokenizer,
        hidden_size=256,
        num_layers=8,
        num_key_value_heads=2,
        intermediate_size=512,
        max_position_embeddings=1024,
        seed=0,
    )
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    dataset = Dataset.from_list([{"prompt": p, "answer": "0"} for p in prompts])
    reward = lambda completions, **kw: [0.0] * len(completions)  # noqa: E731

    sandbox = LocalSandbox(num_workers=2, timeout_s=5.0)
    grpo = GRPOTrainer(
        model_dir,
        reward_funcs=reward,
        args=GRPOConfig(**common_args(tmp + "/g", args.batch, max_len)),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    retool = ReToolTrainer(
        model_dir,
        reward_funcs=reward,
        args=ReToolConfig(**common_args(tmp + "/r", args.batch, max_len)),
        train_dataset=dataset,
        processing_class=tokenizer,
        sandbox=sandbox,
    )
    for trainer in (grpo, retool):
        trainer.model.eval()
    forcing(grpo.model, plain_turns, tokenizer)
    forcing(retool.model, tool_turns, tokenizer)

    # Correctness of the workload before timing: same tokens, two calls each, all outputs right.
    _, completion_ids, tool_mask, *_ = retool._generate(prompts)
    assert [len(c) for c in completion_ids] == tokens_per_completion, "rollout produced a different token count"
    assert all(tokenizer.decode(c, skip_special_tokens=True) == t for c, t in zip(completion_ids, full_texts))
    _, plain_ids, *_ = grpo._generate(prompts)
    assert [len(c) for c in plain_ids] == tokens_per_completion
    interp_tokens = sum(len(m) - sum(m) for m in tool_mask)

    timings = {"plain": [], "rollout": [], "seed": []}
    scripts_ids = [tool_turns[tuple(p)] for p in prompt_ids]
    seed_model = retool.model
    for _ in range(args.repeats):  # interleaved, so drifts in machine load hit every row alike
        timings["plain"].append(median_time(lambda: grpo._generate(prompts), 1))
        timings["rollout"].append(median_time(lambda: retool._generate(prompts), 1))
        timings["seed"].append(
            median_time(lambda: seed_loop(seed_model, tokenizer, prompt_ids, scripts_ids, sandbox), 1)
        )
    plain, rollout, seed = (statistics.median(timings[k]) for k in ("plain", "rollout", "seed"))

    # Step benchmark: same no-code completions through both trainers (generation + scoring + loss + backward).
    step_times = {"grpo": [], "retool": []}
    no_code = {
        tuple(p): [tokenizer(f"The answer is \\boxed{{{i}}}.", add_special_tokens=False)["input_ids"]]
        for i, p in enumerate(prompt_ids)
    }
    for repeat in range(2):  # alternated, so warm-up and load drift do not favour one trainer
        for name, cls, config_cls in (("grpo", GRPOTrainer, GRPOConfig), ("retool", ReToolTrainer, ReToolConfig)):
            extra = {"sandbox": sandbox} if cls is ReToolTrainer else {}
            cfg = config_cls(
                **{**common_args(f"{tmp}/{name}_step{repeat}", args.batch, max_len), "max_steps": args.steps}
            )
            trainer = cls(
                model_dir, reward_funcs=reward, args=cfg, train_dataset=dataset, processing_class=tokenizer, **extra
            )
            forcing(trainer.model, no_code, tokenizer)
            step_times[name].append(median_time(trainer.train, 1))
    step_times = {name: min(times) for name, times in step_times.items()}
    sandbox.close()

    calls = 2 * args.batch
    rows = [
        ("TRL GRPOTrainer generate (no tools)", plain, 1.0),
        (f"ReTool interleaved rollout ({calls} code calls)", rollout, rollout / plain),
        ("seed-style per-token loop", seed, seed / plain),
    ]
    print(
        f"\nRollout benchmark: Qwen2 {n_params / 1e6:.1f}M params, B={args.batch}, "
        f"{sum(tokens_per_completion)} tokens ({interp_tokens} interpreter), {calls} calls, "
        f"median of {args.repeats}"
    )
    print(f"{'generator':<44}{'wall s':>10}{'x plain':>10}")
    for name, seconds, ratio in rows:
        print(f"{name:<44}{seconds:>10.3f}{ratio:>10.2f}")
    print(f"{'TRL native tools= loop':<44}{'n/a':>10}{'n/a':>10}   ({NATIVE_TOOLS_NOTE[:60]}...)")
    print(f"\nseed loop / rollout: {seed / rollout:.2f}x slower")
    print(
        f"training steps ({args.steps}, no code): ReToolTrainer {step_times['retool']:.2f}s vs GRPOTrainer "
        f"{step_times['grpo']:.2f}s -> {step_times['retool'] / step_times['grpo']:.3f}x"
    )
    figures = {
        "rollout_vs_generate": round(rollout / plain, 4),
        "seed_loop_vs_rollout": round(seed / rollout, 4),
        "step_vs_grpo_step": round(step_times["retool"] / step_times["grpo"], 4),
        "plain_generate_s": round(plain, 4),
        "rollout_s": round(rollout, 4),
        "seed_loop_s": round(seed, 4),
        "batch": args.batch,
        "tokens": sum(tokens_per_completion),
        "interpreter_tokens": interp_tokens,
        "tool_calls": calls,
        "params_m": round(n_params / 1e6, 2),
        "native_tools_loop": None,
        # Every repeat's wall, so the spread of each figure is in the file too.
        "plain_generate_s_min": round(min(timings["plain"]), 4),
        "plain_generate_s_max": round(max(timings["plain"]), 4),
        "rollout_s_min": round(min(timings["rollout"]), 4),
        "rollout_s_max": round(max(timings["rollout"]), 4),
        "rollout_vs_generate_min": round(min(r / p for r, p in zip(timings["rollout"], timings["plain"])), 4),
        "rollout_vs_generate_max": round(max(r / p for r, p in zip(timings["rollout"], timings["plain"])), 4),
        "seed_loop_vs_rollout_min": round(min(s / r for s, r in zip(timings["seed"], timings["rollout"])), 4),
        "seed_loop_vs_rollout_max": round(max(s / r for s, r in zip(timings["seed"], timings["rollout"])), 4),
        "repeats": args.repeats,
    }
    results_log.record("rollout", figures, args.run, enabled=not args.no_record)
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
