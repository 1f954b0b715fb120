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
from pathlib import Path

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
    and output processing), the sequences each step carried (a step's cost on a small model is mostly fixed, so a
    step that carries few sequences is the expensive kind), the steps that prefilled prompt tokens and, from each
    finished request, the prompt tokens prefilled (its prompt less vLLM's `num_cached_tokens`, the prefix-cache
    hits)."""

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

        engine.step = counted_step  # LLM.generate and the async engine step their engine through this attribute
        # The engine core runs in this process (TRL starts it with the external launcher): its scheduler says what
        # each step carried.
        scheduler = getattr(getattr(getattr(engine, "engine_core", None), "engine_core", None), "scheduler", None)
        if scheduler is not None:
            schedule = scheduler.schedule

            def counted_schedule(*args, **kwargs):
                out = schedule(*args, **kwargs)
                running = len(out.num_scheduled_tokens)
                if running:
                    self.sequences += running
                    self.prefill_steps += out.total_num_scheduled_tokens > running
                return out

            scheduler.schedule = counted_schedule

    def reset(self):
        self.steps, self.step_s, self.requests, self.prefilled, self.cached = 0, 0.0, 0, 0, 0
        self.sequences, self.prefill_steps = 0, 0

    def snapshot(self) -> dict:
        return {
            "steps": self.steps,
            "step_ms": 1e3 * self.step_s / max(1, self.steps),
            "step_s": self.step_s,
            "requests": self.requests,
            "prefilled": self.prefilled,
            "cached": self.cached,
            "sequences_per_step": self.sequences / max(1, self.steps),
            "prefill_steps": self.prefill_steps,
        }


def _spread(values) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


@contextmanager
def _kv_block_size(size: int | None):
    """vLLM's KV block size for the colocated engine TRL builds (`block_size` passed to its `LLM`). The CPU build
    defaults to 128-token blocks; GPU builds use 16. A benchmark setting only: it changes how much of a continued
    turn the prefix cache can serve (whole blocks only)."""
    if not size:
        yield
        return
    import trl.generation.vllm_generation as helper_module

    original = helper_module.LLM
    helper_module.LLM = lambda *args, **kwargs: original(*args, **{**kwargs, "block_size": size})
    try:
        yield
    finally:
        helper_module.LLM = original


def _separate_cores() -> str:
    """The engine on core 0 with one thread, the sandbox (its zygote and every jail it starts) on the other cores.

    On a GPU node the forward runs on the GPU and the sandbox's work (cells, jail set-up, the teardown of closed
    sessions) on host cores the engine does not need. On this CPU build the forward runs on the cores themselves with
    one OpenMP thread per core, and any other runnable process (a cell, a jail starting) preempts one of them and
    stalls the step at its next barrier: measured together, the sandbox's work shows up as slower engine steps. Apart,
    what is left is the rollout's own cost. A benchmark setting: vLLM fixes its thread count at start-up
    (`torch.set_num_threads` is disabled after it binds), so this calls torch's own setter."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--separate-cores needs at least 2 CPUs")
    torch._C.set_num_threads(1)
    os.sched_setaffinity(0, {cores[0]})  # this thread (the engine's); threads it starts later inherit it

    def descendants(pid: int) -> list[int]:
        found = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                children = Path(f"/proc/{pid}/task/{task}/children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                found += [child, *descendants(child)]
        return found

    pinned = 0
    for pid in descendants(os.getpid()):  # the zygote forks every jail: they inherit its cores
        try:
            os.sched_setaffinity(pid, set(cores[1:]))
            pinned += 1
        except OSError:
            pass
    if not pinned:
        raise SystemExit("--separate-cores: found no sandbox process to move")
    return f"engine on core {cores[0]} (1 thread), sandbox on cores {','.join(map(str, cores[1:]))}"


ROLLOUTS = ("async", "barrier")  # ReToolConfig.rollout_mode: the default first
SETTLE_S = 1.0  # pause before each timed run (see the loop)


def bench_vllm(args) -> None:
    if args.repeats < 3:
        raise SystemExit("--repeats must be at least 3 with --backend vllm: one run cannot tell a change from noise")
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from retool_trl import ReToolConfig, ReToolTrainer
    from retool_trl.data.synthetic import make_arithmetic_dataset
    from retool_trl.quickstart import model_path
    from retool_trl.rollout import RolloutSpec, interleaved_rollout
    from retool_trl.rollout.engines.vllm_batched import VLLMBackend
    from retool_trl.rollout.engines.vllm_colocate import ColocateEngine
    from retool_trl.rollout.per_completion import async_rollout
    from retool_trl.sandbox import LocalSandbox

    tokenizer = AutoTokenizer.from_pretrained(model_path())
    dataset = make_arithmetic_dataset(args.batch, seed=3)
    config = ReToolConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_vllm_"),
        # One training step's generation batch: TRL sizes the engine's `max_num_seqs` to it, so every row of the
        # rollout is in the engine's batch at once, as in training.
        per_device_train_batch_size=args.batch,
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
    with _kv_block_size(args.kv_block_size):
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
    session = sandbox.session()  # the sandbox's zygote starts now (a process to place)
    session.run("1")
    session.close()
    cores = (
        _separate_cores() if args.separate_cores else "shared: the engine's threads on every core, beside the sandbox"
    )
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in dataset["prompt"]]
    spec = RolloutSpec(max_completion_length=64, eos_token_ids=[tokenizer.eos_token_id], max_tool_calls=2)

    engine_clock, sandbox_clock = _Clock(), _Clock()
    _timed(helper, "generate", engine_clock)
    _timed(sandbox, "run_many", sandbox_clock)
    meter = _EngineMeter(helper.llm.llm_engine)

    def barrier():
        return interleaved_rollout(prompts, VLLMBackend(helper, tokenizer, "</code>"), sandbox, tokenizer, spec)

    def per_completion():
        return async_rollout(prompts, ColocateEngine(helper, tokenizer, "</code>"), sandbox, tokenizer, spec)

    rollouts = {"async": per_completion, "barrier": barrier}
    result = barrier()  # warm-up, and the token counts the plain generate must match
    assert per_completion().completion_ids == result.completion_ids, "the async and barrier rollouts differ"
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
    generators = {**rollouts, "plain": plain, "plain_sampled": lambda: plain(sampled)}
    times = {name: [] for name in generators}
    metered = {name: [] for name in generators}
    engine_s, sandbox_s = [], []
    for repeat in range(args.repeats):
        for name, generate in generators.items():  # alternated: load drifts hit every generator alike
            # Each run starts on a quiet machine, as a training step's rollout follows its update: what the sandbox
            # does in the background (closed sessions ending, the jails the last rollout reserved for the next one
            # setting up) is done by then, and overlaps no measured run.
            time.sleep(SETTLE_S)
            engine_clock.seconds = sandbox_clock.seconds = 0.0
            meter.reset()
            start = time.perf_counter()
            out = generate()
            times[name].append(time.perf_counter() - start)
            metered[name].append(meter.snapshot())
            if name == "barrier":
                engine_s.append(engine_clock.seconds)
                sandbox_s.append(sandbox_clock.seconds)
            if name in rollouts:
                assert out.completion_ids == result.completion_ids, f"greedy {name} rollout changed between repeats"
        print(f"  repeat {repeat + 1}/{args.repeats}: " + ", ".join(f"{n} {t[-1]:.3f} s" for n, t in times.items()))
    trainer.close_sandbox()
    wall = {name: statistics.median(values) for name, values in times.items()}
    engine_med, sandbox_med = statistics.median(engine_s), statistics.median(sandbox_s)
    other_s = wall["barrier"] - engine_med - sandbox_med
    # Per alternated run: each rollout over the plain generate made in the same repeat.
    ratios = {
        (name, base): _spread([r / p for r, p in zip(times[name], times[base], strict=True)])
        for name in rollouts
        for base in ("plain", "plain_sampled")
    }
    # The engine's share alone: time inside vLLM's steps, the rollout's over plain generate's of the same sampled
    # tokens (no interpreter tokens to decode), per alternated run. Sandbox time and our bookkeeping are outside it.
    engine_ratios = {
        name: _spread(
            [r["step_s"] / p["step_s"] for r, p in zip(metered[name], metered["plain_sampled"], strict=True)]
        )
        for name in rollouts
    }
    tokens, interp = sum(lengths), sum(len(m) - sum(m) for m in result.interpreter_mask)
    calls, turns, engine_calls = sum(result.num_tool_calls), max(result.num_turns), result.engine_calls[0]
    cache = getattr(getattr(helper.llm.llm_engine, "vllm_config", None), "cache_config", None)
    block = getattr(cache, "block_size", None)
    max_seqs = getattr(getattr(helper.llm.llm_engine.vllm_config, "scheduler_config", None), "max_num_seqs", None)

    print(
        f"\nvLLM rollout benchmark (colocate, vLLM CPU build): quickstart model, B={args.batch} (max_num_seqs "
        f"{max_seqs}), KV blocks of {block} tokens, cores {cores},\n{tokens} tokens ({interp} interpreter), "
        f"{calls} code calls, "
        f"{turns} turns, median of {args.repeats} alternated runs"
    )
    print(f"{'generator':<52}{'wall s':>10}{'x plain':>10}  (min-max)")
    labels = {
        "plain": "vLLM plain generate (same tokens, one call)",
        "plain_sampled": "vLLM plain generate (sampled tokens only)",
        "async": "rollout, async (per completion; the default)",
        "barrier": "rollout, barrier (one engine call per turn)",
    }
    for name in ("plain", "plain_sampled", *rollouts):
        spread = ratios.get((name, "plain")) or _spread([s / p for s, p in zip(times[name], times["plain"])])
        print(
            f"{labels[name]:<52}{wall[name]:>10.3f}{spread['median']:>10.2f}  "
            f"({spread['min']:.2f}-{spread['max']:.2f})"
        )
    print(
        f"  barrier rollout: engine calls {engine_med:.3f} s, sandbox {sandbox_med:.3f} s, "
        f"rest (decode, stop search, encode, bookkeeping) {other_s:.3f} s"
    )
    for name, spread in engine_ratios.items():
        print(
            f"  {name} rollout, time in engine steps / plain generate's (sampled tokens): {spread['median']:.2f} "
            f"({spread['min']:.2f}-{spread['max']:.2f})"
        )
    print(f"engine start (colocated LLM load, once per training run): {engine_start_s:.1f} s")
    # Counts are the same every repeat (greedy, same tokens); the per-step time is each run's, medianed.
    meters = {}
    for name, runs in metered.items():
        meters[name] = {
            **runs[-1],
            "step_ms": statistics.median(r["step_ms"] for r in runs),
            "outside_steps_s": statistics.median(t - r["step_s"] for t, r in zip(times[name], runs, strict=True)),
        }
    print(
        f"{'':<14}{'steps':>7}{'ms/step':>9}{'seqs/step':>11}{'prefill steps':>15}{'prefilled':>11}"
        f"{'cached':>8}{'requests':>10}{'outside steps s':>17}"
    )
    for name, m in meters.items():
        print(
            f"  {name:<12}{m['steps']:>7}{m['step_ms']:>9.2f}{m['sequences_per_step']:>11.1f}{m['prefill_steps']:>15}"
            f"{m['prefilled']:>11}{m['cached']:>8}{m['requests']:>10}{m['outside_steps_s']:>17.3f}"
        )
    figures = {}
    for name, key in (("async", "vllm_rollout_vs_generate"), ("barrier", "vllm_barrier_vs_generate")):
        for base, suffix in (("plain", ""), ("plain_sampled", "_sampled")):
            spread = ratios[(name, base)]
            figures[f"{key}{suffix}"] = round(spread["median"], 4)
            figures[f"{key}{suffix}_min"] = round(spread["min"], 4)
            figures[f"{key}{suffix}_max"] = round(spread["max"], 4)
    for name, key in (("async", "vllm_rollout_engine_vs_generate"), ("barrier", "vllm_barrier_engine_vs_generate")):
        spread = engine_ratios[name]
        figures[key] = round(spread["median"], 4)
        figures[f"{key}_min"], figures[f"{key}_max"] = round(spread["min"], 4), round(spread["max"], 4)
    figures.update(
        {
            "rollout_mode": "async",  # the mode of vllm_rollout_vs_generate (ReToolConfig's default)
            "repeats": args.repeats,
            "rollout_s": round(wall["async"], 4),
            "barrier_rollout_s": round(wall["barrier"], 4),
            "plain_generate_sampled_s": round(wall["plain_sampled"], 4),
            "plain_generate_s": round(wall["plain"], 4),
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
            "max_num_seqs": max_seqs,
            "mode": "colocate",
            "kv_block_size": block,  # a continued turn re-prefills its last, partly filled block
            "kv_block_size_set": bool(args.kv_block_size),
            "separate_cores": bool(args.separate_cores),
            "cores": cores,
            "prefix_caching": getattr(cache, "enable_prefix_caching", None),
        }
    )
    for prefix, name in (
        ("rollout", "async"),
        ("barrier", "barrier"),
        ("plain", "plain"),
        ("plain_sampled", "plain_sampled"),
    ):
        m = meters[name]
        figures[f"{prefix}_engine_steps"] = m["steps"]
        figures[f"{prefix}_step_ms"] = round(m["step_ms"], 3)
        figures[f"{prefix}_sequences_per_step"] = round(m["sequences_per_step"], 2)
        figures[f"{prefix}_prefill_steps"] = m["prefill_steps"]
        figures[f"{prefix}_outside_steps_s"] = round(m["outside_steps_s"], 4)
        figures[f"{prefix}_engine_requests"] = m["requests"]
        figures[f"{prefix}_prefill_tokens"] = m["prefilled"]
        figures[f"{prefix}_cached_tokens"] = m["cached"]
    results_log.record("vllm_rollout", figures, args.run, enabled=not args.no_record)
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    raise SystemExit("run: python scripts/bench_rollout.py --backend vllm [--json]")
