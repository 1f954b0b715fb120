"""`bench_rollout.py --backend vllm`: the interleaved rollout through a real vLLM engine vs plain vLLM generate.

Same engine, same prompts, same number of tokens per row, measured side by side in one run: `repeats` (at least 3)
alternated runs, so that load drifts hit both alike; each ratio is the median of the per-run ratios, printed and
carried in the JSON with its min-max. Run with `.venv-engines/bin/python` (vLLM's CPU build).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from contextlib import contextmanager

import results_log

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


class _Clock:
    """Wall time spent inside wrapped calls (engine requests, sandbox batches)."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0

    @contextmanager
    def __call__(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def _timed(obj, name: str, clock: _Clock):
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        with clock():
            return original(*args, **kwargs)

    setattr(obj, name, wrapper)


class _EngineMeter:
    """vLLM's own account of what a generator cost: the engine steps it took (each timed: scheduling, the forward
    and output processing) and, from each finished request, the prompt tokens prefilled (its prompt less vLLM's
    `num_cached_tokens`, the prefix-cache hits)."""

    def __init__(self, engine):
        self.reset()
        step = engine.step

        def counted_step():
            start = time.perf_counter()
            outputs = step()
            self.step_s += time.perf_counter() - start
            self.steps += 1
            for out in outputs:
                if getattr(out, "finished", False) and getattr(out, "prompt_token_ids", None) is not None:
                    cached = out.num_cached_tokens or 0
                    self.requests += 1
                    self.prefilled += len(out.prompt_token_ids) - cached
                    self.cached += cached
            return outputs

        engine.step = counted_step  # LLM.generate steps its engine through this attribute

    def reset(self):
        self.steps, self.step_s, self.requests, self.prefilled, self.cached = 0, 0.0, 0, 0, 0

    def snapshot(self) -> dict:
        return {
            "steps": self.steps,
            "step_ms": 1e3 * self.step_s / max(1, self.steps),
            "requests": self.requests,
            "prefilled": self.prefilled,
            "cached": self.cached,
        }


def _spread(values) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench_vllm(args) -> None:
    if args.repeats < 3:
        raise SystemExit("--repeats must be at least 3 with --backend vllm: one run cannot tell a change from noise")
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from retool_trl import ReToolConfig, ReToolTrainer
    from retool_trl.data.synthetic import make_arithmetic_dataset
    from retool_trl.quickstart import model_path
    from retool_trl.rollout.batched import RolloutSpec, interleaved_rollout
    from retool_trl.rollout.engines.vllm_batched import VLLMBackend
    from retool_trl.sandbox import LocalSandbox

    tokenizer = AutoTokenizer.from_pretrained(model_path())
    dataset = make_arithmetic_dataset(args.batch, seed=3)
    config = ReToolConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_vllm_"),
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=64,
        max_tool_calls=2,
        max_interpreter_output_chars=64,
        system_prompt="none",
        report_to="none",
        use_cpu=True,
        bf16=False,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=512,
        disable_tqdm=True,
    )
    started = time.perf_counter()
    trainer = ReToolTrainer(
        model_path(),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        sandbox=LocalSandbox(num_workers=2, timeout_s=5.0),
    )
    engine_start_s = time.perf_counter() - started
    helper, sandbox = trainer.vllm_generation, trainer.sandbox
    helper.temperature = 0.0  # greedy: every repeat makes the same tokens
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in dataset["prompt"]]
    spec = RolloutSpec(max_completion_length=64, eos_token_ids=[tokenizer.eos_token_id], max_tool_calls=2)

    engine_clock, sandbox_clock = _Clock(), _Clock()
    _timed(helper, "generate", engine_clock)
    _timed(sandbox, "run_many", sandbox_clock)
    meter = _EngineMeter(helper.llm.llm_engine)

    def rollout():
        return interleaved_rollout(prompts, VLLMBackend(helper, tokenizer, "</code>"), sandbox, tokenizer, spec)

    result = rollout()  # warm-up, and the token counts the plain generate must match
    lengths = [len(ids) for ids in result.completion_ids]
    sampled = [sum(mask) for mask in result.interpreter_mask]  # tokens the policy wrote (no interpreter tokens)

    def plain(counts=lengths):
        # `ignore_eos` with `max_tokens = n`: exactly n decoded tokens per row, in one call.
        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, logprobs=0) for n in counts]
        outputs = helper.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sampling_params=params, use_tqdm=False
        )
        return [len(o.outputs[0].token_ids) for o in outputs]

    assert plain() == lengths, "plain generate made a different number of tokens"
    assert plain(sampled) == sampled
    times = {"rollout": [], "plain": [], "plain_sampled": []}
    engine_s, sandbox_s = [], []
    metered = {name: [] for name in times}
    for _ in range(args.repeats):
        engine_clock.seconds = sandbox_clock.seconds = 0.0
        meter.reset()
        start = time.perf_counter()
        again = rollout()
        times["rollout"].append(time.perf_counter() - start)
        metered["rollout"].append(meter.snapshot())
        engine_s.append(engine_clock.seconds)
        sandbox_s.append(sandbox_clock.seconds)
        assert again.completion_ids == result.completion_ids, "greedy rollout changed between repeats"
        meter.reset()
        start = time.perf_counter()
        plain()
        times["plain"].append(time.perf_counter() - start)
        metered["plain"].append(meter.snapshot())
        meter.reset()
        start = time.perf_counter()
        plain(sampled)
        times["plain_sampled"].append(time.perf_counter() - start)
        metered["plain_sampled"].append(meter.snapshot())
    trainer.close_sandbox()
    rollout_s, plain_s = statistics.median(times["rollout"]), statistics.median(times["plain"])
    plain_sampled_s = statistics.median(times["plain_sampled"])
    engine_med, sandbox_med = statistics.median(engine_s), statistics.median(sandbox_s)
    other_s = rollout_s - engine_med - sandbox_med
    # Per alternated run: the rollout over the plain generate made right after it.
    ratio = _spread([r / p for r, p in zip(times["rollout"], times["plain"], strict=True)])
    ratio_sampled = _spread([r / p for r, p in zip(times["rollout"], times["plain_sampled"], strict=True)])
    tokens, interp = sum(lengths), sum(len(m) - sum(m) for m in result.interpreter_mask)
    calls, turns, engine_calls = sum(result.num_tool_calls), max(result.num_turns), result.engine_calls[0]

    print(
        f"\nvLLM rollout benchmark (colocate, vLLM CPU build): quickstart model, B={args.batch}, {tokens} "
        f"tokens ({interp} interpreter), {calls} code calls, {turns} turns, {engine_calls} engine calls, "
        f"median of {args.repeats} alternated runs"
    )
    print(f"{'generator':<48}{'wall s':>10}{'x plain':>10}")
    print(f"{'vLLM plain generate (same tokens, one call)':<48}{plain_s:>10.3f}{1.0:>10.2f}")
    print(
        f"{'vLLM plain generate (sampled tokens only)':<48}{plain_sampled_s:>10.3f}{plain_sampled_s / plain_s:>10.2f}"
    )
    print(f"{'ReTool interleaved rollout through vLLM':<48}{rollout_s:>10.3f}{ratio['median']:>10.2f}")
    print(
        f"rollout / plain generate, per alternated run: median {ratio['median']:.2f} (min {ratio['min']:.2f}, "
        f"max {ratio['max']:.2f}); over the sampled tokens only: median {ratio_sampled['median']:.2f} "
        f"(min {ratio_sampled['min']:.2f}, max {ratio_sampled['max']:.2f})"
    )
    print(
        f"  of which engine calls: {engine_med:.3f} s, sandbox: {sandbox_med:.3f} s, "
        f"rest (decode, stop search, encode, bookkeeping): {other_s:.3f} s"
    )
    print(f"engine start (colocated LLM load, once per training run): {engine_start_s:.1f} s")
    # Counts are the same every repeat (greedy, same tokens); the per-step time is each run's, medianed.
    meters = {
        name: {**runs[-1], "step_ms": statistics.median(r["step_ms"] for r in runs)} for name, runs in metered.items()
    }
    for name, m in meters.items():
        print(
            f"  {name:<14} engine steps {m['steps']:>4}, {m['step_ms']:.2f} ms per step (median), "
            f"{m['requests']} requests, {m['prefilled']} prompt tokens prefilled ({m['cached']} from the prefix cache)"
        )
    figures = {
        "vllm_rollout_vs_generate": round(ratio["median"], 4),
        "vllm_rollout_vs_generate_min": round(ratio["min"], 4),
        "vllm_rollout_vs_generate_max": round(ratio["max"], 4),
        "vllm_rollout_vs_generate_sampled": round(ratio_sampled["median"], 4),
        "vllm_rollout_vs_generate_sampled_min": round(ratio_sampled["min"], 4),
        "vllm_rollout_vs_generate_sampled_max": round(ratio_sampled["max"], 4),
        "repeats": args.repeats,
        "rollout_s": round(rollout_s, 4),
        "plain_generate_sampled_s": round(plain_sampled_s, 4),
        "plain_generate_s": round(plain_s, 4),
        "engine_calls_s": round(engine_med, 4),
        "sandbox_s": round(sandbox_med, 4),
        "other_s": round(other_s, 4),
        "engine_start_s": round(engine_start_s, 2),
        "engine_calls": engine_calls,
        "turns": turns,
        "tool_calls": calls,
        "tokens": tokens,
        "interpreter_tokens": interp,
        "batch": args.batch,
        "mode": "colocate",
    }
    cache = getattr(getattr(helper.llm.llm_engine, "vllm_config", None), "cache_config", None)
    figures["kv_block_size"] = getattr(cache, "block_size", None)  # a continued turn re-prefills its last block
    figures["prefix_caching"] = getattr(cache, "enable_prefix_caching", None)
    for prefix, m in meters.items():
        figures[f"{prefix}_engine_steps"] = m["steps"]
        figures[f"{prefix}_step_ms"] = round(m["step_ms"], 3)
        figures[f"{prefix}_engine_requests"] = m["requests"]
        figures[f"{prefix}_prefill_tokens"] = m["prefilled"]
        figures[f"{prefix}_cached_tokens"] = m["cached"]
    results_log.record("vllm_rollout", figures, args.run, enabled=not args.no_record)
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    raise SystemExit("run: python scripts/bench_rollout.py --backend vllm [--json]")
