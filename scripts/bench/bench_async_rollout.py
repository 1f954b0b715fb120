"""Async vs barrier rollout, and ReTool vs TRL's own `tools=` loop, on a real vLLM engine (server and colocated).

A straggler workload, as real runs have: B completions, each with 2-4 code calls, long-tailed turn lengths and
long-tailed snippet latencies (most a few ms, some 100-300 ms; the snippets really sleep, in the local sandbox).
The policy text is forced with vLLM's structured outputs (a regex per turn), so every mode runs the same tokens through
the same engine. The regex fixes the text, not its tokens: greedy decoding picks the tokenization, so `same_outputs`
(identical token ids, masks and reward kwargs) checks that both modes sample from identical contexts.

1. barrier: `interleaved_rollout` whose turns send every active sequence's request at once and wait for all, then
   run all snippets at once and wait for all (the barrier of today's loop, with the same engine: on the server, the
   turns sent at once share requests);
2. async: `async_rollout`, each completion its own loop (on the server, the turns ready at once share a request);
3. floor: plain generate of exactly the tokens the policy sampled in the async rollout (EOS ignored; no snippets, no
   interpreter tokens), in as few calls as the engine allows (see `floor_run`). `async_vs_floor` (async wall / floor
   wall) is what the multi-turn loop costs over decoding the same tokens at once: the snippets' latencies on the
   critical path, the prefill of interpreter blocks and continued turns, the requests and the client's own CPU;
4. TRL (server only): `GRPOTrainer(tools=[work])._generate` with the same server, a tiny model given TRL's bundled
   Qwen3 tool-calling chat template and its special tokens, every turn forced to one tool call: the same number of
   calls per completion and the same latencies, in TRL's loop.

`--engine server` runs them against TRL's vLLM server, `--engine colocate` against a vLLM `LLM` built as TRL's
colocate mode builds it (`external_launcher`: the engine runs in this process) and driven request by request,
`--engine both` (the default) one after the other. Turn lengths are long-tailed and drawn per turn (`--turns
long-tailed`, the default), or one length for all code turns of a completion (`--turns even`), see `make_workload`.
The model's forward runs on one thread (`OMP_NUM_THREADS=1` unless set), leaving the other cores to the loop and the
sandbox. Each figure is the median over `--runs` (at least 3) alternated rounds (one run of each mode per round;
ratios are taken within a round), printed with its min-max; the JSON carries all three (`async_vs_barrier`,
`async_vs_floor`, `trl_tools_vs_retool`, ... with `_min`/`_max`; the colocated engine's keys start with `colocate_`).
`barrier_vs_floor` (barrier wall / floor wall) is an upper bound on `async_vs_barrier`: no rollout of these tokens
beats the floor (which also skips the interpreter tokens and the forcing regex), so where generating them is most of
the barrier's time, async has little to win.

Run with the engines' environment (`bash scripts/test_engines.sh` builds it):

    .venv-engines/bin/python scripts/bench_async_rollout.py [--engine both] [--batch 32] [--runs 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The model's forward gets one core and the rollout's loop, snippets and sandbox the rest, as on a GPU host, where the
# forward does not take the host's cores. With the forward's threads on every core, each cell or loop wake-up stalls a
# forward's spin-waiting threads (vLLM warns about multi-threaded torch ops when serving). Set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import statistics  # noqa: E402

import httpx  # noqa: E402
import results_log  # noqa: E402
from bench_async_parts import (  # noqa: E402
    TOOL_CALL,
    BarrierOverEngine,
    ForcedColocateEngine,
    ForcedEngine,
    Latencies,
    Server,
    build_model,
    colocated_llm,
    make_workload,
    spread,
)
from gpu_cost_model import MODELS, run_gpu_model  # noqa: E402

from retool_trl.rollout.batched import RolloutSpec, interleaved_rollout  # noqa: E402
from retool_trl.rollout.per_completion import async_rollout  # noqa: E402
from retool_trl.sandbox import LocalSandbox  # noqa: E402


# ----------------------------------------------------------------------------------------------------- the modes
def floor_run(target, prompts, counts) -> list[int]:
    """The same-tokens floor: plain generate of exactly `counts[i]` tokens after each prompt (EOS ignored), as few
    calls as the engine allows: one `LLM.generate` with a `SamplingParams` per prompt in-process; on the server (one
    `max_tokens` per request) one request per distinct count, all sent at once. Returns the tokens each row got."""
    if not isinstance(target, str):
        from vllm import SamplingParams

        params = [
            SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0, logprobs=0) for n in counts
        ]
        outputs = target.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outputs]
    groups = defaultdict(list)
    for i, n in enumerate(counts):
        groups[n].append(i)

    async def all_groups():
        async with httpx.AsyncClient(base_url=target, timeout=None) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]

            async def one(n, rows):
                body = {
                    "model": model,
                    "prompt": [prompts[i] for i in rows],
                    "max_tokens": n,
                    "min_tokens": n,
                    "ignore_eos": True,
                    "temperature": 0.0,
                    "logprobs": 0,
                    "return_token_ids": True,
                }
                reply = (await client.post("/v1/completions", json=body)).json()
                return rows, [len(c["token_ids"]) for c in sorted(reply["choices"], key=lambda c: c["index"])]

            return await asyncio.gather(*(one(n, rows) for n, rows in groups.items()))

    got = [0] * len(counts)
    for rows, lengths in asyncio.run(all_groups()):
        for i, length in zip(rows, lengths, strict=True):
            got[i] = length
    return got


def retool_modes(target, tokenizer, workload, max_len, runs, modes=("barrier", "async", "floor")):
    """Barrier, async and the same-tokens floor, alternated `runs` times, against `target`: a server URL or a
    colocated helper."""
    prompts = [tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] for row in workload]
    assert len({tuple(p) for p in prompts}) == len(prompts) and len({len(p) for p in prompts}) == 1
    spec = RolloutSpec(
        max_completion_length=max_len,
        eos_token_ids=[tokenizer.eos_token_id],
        max_tool_calls=4,
        max_interpreter_output_chars=256,
    )

    def engine():
        scripts = {tuple(p): row["turns"] for p, row in zip(prompts, workload)}
        if isinstance(target, str):
            return ForcedEngine(target, tokenizer, "</code>", sampling={"temperature": 0.0}, scripts=scripts)
        return ForcedColocateEngine(target, tokenizer, "</code>", scripts=scripts)

    results, seconds, client_cpu = {}, {m: [] for m in modes}, {m: [] for m in modes}
    with LocalSandbox(num_workers=2, timeout_s=5.0) as box:
        box.session().run("print(1)")  # the zygote is up before the clock starts
        # One untimed round first (compiling the regexes, warming the caches), then alternated timed rounds, so that
        # a load change hits every mode alike.
        for k, mode in enumerate(modes * (runs + 1)):
            sandbox = Latencies(box, workload)
            started, cpu = time.perf_counter(), time.process_time()
            if mode == "async":
                result = async_rollout(prompts, engine(), sandbox, tokenizer, spec, max_concurrency=len(prompts))
            elif mode == "barrier":
                backend = BarrierOverEngine(engine())
                try:
                    result = interleaved_rollout(prompts, backend, sandbox, tokenizer, spec)
                finally:
                    backend.close()
            else:  # the tokens the policy sampled in the async rollout (interpreter tokens are not sampled)
                sampled = [sum(mask) for mask in results["async"].interpreter_mask]
                assert floor_run(target, prompts, sampled) == sampled, "the floor made other token counts"
                result = sampled
            results[mode] = result
            if k < len(modes):
                continue
            seconds[mode].append(time.perf_counter() - started)
            # This process's CPU time (requests, JSON, decoding turns, encoding interpreter blocks; with the colocated
            # engine also the engine's own scheduling): the rollout's overhead, which competes for the same cores.
            client_cpu[mode].append(time.process_time() - cpu)
    return results, seconds, client_cpu


def same_outputs(results) -> bool:
    a, b = results["async"], results["barrier"]
    return (
        a.completion_ids == b.completion_ids
        and a.interpreter_mask == b.interpreter_mask
        and a.extra_fields() == b.extra_fields()
    )


def engine_summary(prefix, results, seconds, client_cpu, workload) -> tuple[dict, dict, dict]:
    """Per-run ratios (one per alternated round): barrier/async, async/floor and barrier/floor, median and min-max,
    with the wall times."""
    ratio = spread([b / a for b, a in zip(seconds["barrier"], seconds["async"], strict=True)])
    floor = spread([a / f for a, f in zip(seconds["async"], seconds["floor"], strict=True)])
    # An upper bound on what any rollout of these tokens could gain over the barrier: the floor generates them with
    # no snippets, no turns, no interpreter tokens and no forcing regex.
    headroom = spread([b / f for b, f in zip(seconds["barrier"], seconds["floor"], strict=True)])
    ours = results["async"]
    summary = {
        f"{prefix}async_vs_barrier": ratio["median"],
        f"{prefix}async_vs_barrier_min": ratio["min"],
        f"{prefix}async_vs_barrier_max": ratio["max"],
        f"{prefix}async_vs_floor": floor["median"],
        f"{prefix}async_vs_floor_min": floor["min"],
        f"{prefix}async_vs_floor_max": floor["max"],
        f"{prefix}barrier_vs_floor": headroom["median"],
        f"{prefix}barrier_vs_floor_min": headroom["min"],
        f"{prefix}barrier_vs_floor_max": headroom["max"],
        f"{prefix}same_outputs": same_outputs(results),
        f"{prefix}barrier_seconds": statistics.median(seconds["barrier"]),
        f"{prefix}async_seconds": statistics.median(seconds["async"]),
        f"{prefix}floor_seconds": statistics.median(seconds["floor"]),
        f"{prefix}client_cpu_seconds_async": statistics.median(client_cpu["async"]),
        f"{prefix}client_cpu_seconds_barrier": statistics.median(client_cpu["barrier"]),
        f"{prefix}client_cpu_seconds_floor": statistics.median(client_cpu["floor"]),
        f"{prefix}engine_requests": ours.engine_calls[0],
        f"{prefix}turns": sum(ours.num_turns),
        f"{prefix}calls": sum(ours.num_tool_calls),
        f"{prefix}tokens": sum(len(ids) for ids in ours.completion_ids),
        f"{prefix}sampled_tokens": sum(results["floor"]),
        f"{prefix}snippet_seconds_total": sum(sum(row["latencies"]) for row in workload),
        f"{prefix}snippet_exec_seconds_total": sum(ours.exec_seconds),
    }
    ratios = {"async_vs_barrier": ratio, "async_vs_floor": floor, "barrier_vs_floor": headroom}
    return summary, ratios, {m: spread(v) for m, v in seconds.items()}


# ----------------------------------------------------------------------------------------------------- TRL's loop
def trl_tools(url, model_dir, workload, max_len):
    """TRL's `GRPOTrainer(tools=...)` rollout against the same server: every turn forced to one tool call, as many
    calls per completion as ours, each call sleeping the same latencies (TRL runs sync tools one after another)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.generation import vllm_client

    latencies = [latency for row in workload for latency in row["latencies"]]
    calls = iter(latencies)  # reset by every run

    def work() -> str:
        """Runs the next piece of work.

        Returns:
            What the work printed.
        """
        time.sleep(next(calls))
        return "done"

    # No NCCL on this CPU: the benchmark never syncs weights, so the communicator TRL opens at start-up is skipped.
    vllm_client.VLLMClient.init_communicator = lambda self, device=None: None
    per_row = sorted({len(row["latencies"]) for row in workload})
    assert len(per_row) == 1, "TRL's loop gives every completion the same number of calls"
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=url,
        per_device_train_batch_size=len(workload),
        num_generations=len(workload),
        max_completion_length=max_len,
        temperature=1.0,
        generation_kwargs={"structured_outputs": {"regex": re.escape(TOOL_CALL)}},  # n>1: sampled
        max_tool_calling_iterations=per_row[0],
        report_to="none",
        use_cpu=True,
        bf16=False,
    )
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "Work."}]}] * len(workload))
    trainer = GRPOTrainer(
        str(model_dir),
        reward_funcs=lambda completions, **k: [0.0] * len(completions),
        args=args,
        train_dataset=dataset,
        tools=[work],
    )
    trainer._last_loaded_step = trainer.state.global_step  # nothing to sync
    prompts = [[{"role": "user", "content": "Work."}] for _ in workload]

    def run():
        nonlocal calls
        calls = iter(latencies)
        # The per-rollout tool tables that `_generate_and_score_completions` builds before calling `_generate`.
        trainer._sync_tool_dicts = [{"work": work} for _ in workload]
        trainer._async_tool_dicts = [{} for _ in workload]
        started = time.perf_counter()
        _, completion_ids, tool_mask, *_ = trainer._generate(prompts)
        elapsed = time.perf_counter() - started
        return elapsed, sum(len(ids) for ids in completion_ids), sum(sum(mask) for mask in tool_mask)

    return run


def trl_comparison(url, model_dir, tokenizer, max_len, batch, seed, runs) -> dict:
    """TRL's `tools=` loop vs ReTool's async loop, alternated `runs` times (3 calls per completion, no prose, so that
    the tokens match too)."""
    fixed = make_workload(batch, seed + 1, calls=3, prose=False)
    trl_run = trl_tools(url, model_dir, fixed, max_len)
    trl_run()  # untimed: TRL's first call warms its own caches
    trl_seconds, ours_seconds = [], []
    for _ in range(runs):
        trl_seconds_once, trl_tokens, trl_sampled = trl_run()
        trl_seconds.append(trl_seconds_once)
        ours, seconds, _ = retool_modes(url, tokenizer, fixed, max_len, runs=1, modes=("barrier", "async"))
        ours_seconds.append(seconds["async"][0])
    ratio = spread([t / o for t, o in zip(trl_seconds, ours_seconds, strict=True)])
    return {
        "trl_tools_vs_retool": ratio["median"],
        "trl_tools_vs_retool_min": ratio["min"],
        "trl_tools_vs_retool_max": ratio["max"],
        "trl_seconds": statistics.median(trl_seconds),
        "trl_ours_seconds": statistics.median(ours_seconds),
        "trl_calls": 3 * len(fixed),
        "trl_ours_tokens": sum(len(ids) for ids in ours["async"].completion_ids),
        "trl_ours_sampled_tokens": sum(sum(mask) for mask in ours["async"].interpreter_mask),
        "trl_sampled_tokens": trl_sampled,
        "trl_snippet_seconds_total": sum(sum(row["latencies"]) for row in fixed),
        "trl_tokens": trl_tokens,
    }


def print_engine(title, ratios, walls):
    ratio, floor = ratios["async_vs_barrier"], ratios["async_vs_floor"]
    print(f"{title}: barrier/async {ratio['median']:.2f} (min {ratio['min']:.2f}, max {ratio['max']:.2f})")
    print(f"  async/floor {floor['median']:.2f} (min {floor['min']:.2f}, max {floor['max']:.2f})")
    headroom = ratios["barrier_vs_floor"]
    print(
        f"  barrier/floor {headroom['median']:.2f} (min {headroom['min']:.2f}, max {headroom['max']:.2f}): an upper "
        "bound on what any rollout of these tokens could gain over the barrier"
    )
    for mode in ("barrier", "async", "floor"):
        w = walls[mode]
        print(f"  {mode:<8} wall s: median {w['median']:.2f} (min {w['min']:.2f}, max {w['max']:.2f})")


def gpu_model_main(args, run) -> None:
    """`--engine gpu-model`: the loops against a cost model of a GPU engine; JSON keys `gpu_model_*`."""
    summary = run_gpu_model(args.gpu_model, args.batch, args.seed, args.runs)
    s = summary
    print(f"MODEL of a GPU engine ({s['gpu_model']}), not a GPU: B={args.batch}, {args.runs} alternated runs")
    for mode in ("async", "barrier"):
        g = {k[len("gpu_model_") :]: v for k, v in s.items() if k.startswith("gpu_model_")}
        print(
            f"  {mode:<8} wall {g[f'{mode}_seconds']:.2f} s, ideal {g[f'ideal_{mode}_seconds']:.2f} s: "
            f"{g[f'{mode}_vs_ideal']:.2f}x its ideal (min {g[f'{mode}_vs_ideal_min']:.2f}, max "
            f"{g[f'{mode}_vs_ideal_max']:.2f}); sleep overshoot {g[f'sleep_overshoot_{mode}_s']:.2f} s over "
            f"{g[f'engine_steps_{mode}']} steps"
        )
    print(
        f"  barrier/async {s['gpu_model_async_vs_barrier']:.2f} (min {s['gpu_model_async_vs_barrier_min']:.2f}, max "
        f"{s['gpu_model_async_vs_barrier_max']:.2f}); ideal barrier/ideal async "
        f"{s['gpu_model_ideal_async_vs_barrier']:.2f}; same outputs: {s['gpu_model_same_outputs']}"
    )
    summary = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in summary.items()}
    results_log.record("async_rollout_gpu_model", summary, run, enabled=not args.no_record)
    if args.json:
        print(json.dumps(summary))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--engine",
        choices=("both", "server", "colocate", "gpu-model"),
        default="both",
        help="gpu-model: a cost model of a GPU engine, not a GPU (see gpu_cost_model.py)",
    )
    parser.add_argument(
        "--gpu-model",
        choices=sorted(MODELS),
        default="qwen2.5-1.5b-h100",
        help="with --engine gpu-model: the engine's costs",
    )
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=3, help="Alternated runs per figure (at least 3).")
    parser.add_argument(
        "--turns",
        choices=("long-tailed", "even"),
        default="long-tailed",
        help="Turn lengths: drawn per turn, long-tailed (default), or one length for all code turns of a completion.",
    )
    parser.add_argument(
        "--kinds",
        type=int,
        default=6,
        help="Distinct completion texts (each with its own turn lengths); completions of a kind share their regexes.",
    )
    parser.add_argument(
        "--engine-process",
        action="store_true",
        help="Colocated engine: vLLM's engine core in a process of its own (TRL's colocate mode runs it in-process).",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--skip-trl", action="store_true", help="Skip TRL's tools= loop.")
    results_log.add_arguments(parser)
    args = parser.parse_args()
    run = results_log.conditions()
    if args.engine == "gpu-model":
        return gpu_model_main(args, run)
    if args.runs < 3:
        parser.error("--runs must be at least 3: one run cannot tell a change from noise")
    if args.kinds < 1:
        parser.error("--kinds must be at least 1")

    summary = {  # `turns` (without a prefix) is the server's count of turns, hence `turn_lengths`
        "batch": args.batch,
        "runs": args.runs,
        "turn_lengths": args.turns,
        "kinds": args.kinds,
        "engine_threads": os.environ["OMP_NUM_THREADS"],
    }
    workload = make_workload(args.batch, args.seed, turns=args.turns, kinds=args.kinds)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        tokenizer = build_model(model_dir)
        if args.engine in ("both", "server"):
            server = Server(model_dir, Path(tempfile.gettempdir()) / "retool_bench_async_vllm.log")
            try:
                results, seconds, cpu = retool_modes(server.url, tokenizer, workload, args.max_len, args.runs)
                part, ratio, walls = engine_summary("", results, seconds, cpu, workload)
                summary.update(part)
                print_engine("vLLM server", ratio, walls)
                if not args.skip_trl:
                    trl = trl_comparison(
                        server.url, model_dir, tokenizer, args.max_len, args.batch, args.seed, args.runs
                    )
                    summary.update(trl)
                    print(
                        f"TRL tools= loop / ReTool async (3 calls each): {trl['trl_tools_vs_retool']:.2f} "
                        f"(min {trl['trl_tools_vs_retool_min']:.2f}, max {trl['trl_tools_vs_retool_max']:.2f}); "
                        f"median wall s {trl['trl_seconds']:.2f} vs {trl['trl_ours_seconds']:.2f}"
                    )
            finally:
                server.stop()
        if args.engine in ("both", "colocate"):
            helper = colocated_llm(model_dir, in_process=not args.engine_process)
            summary["colocate_in_process"] = not args.engine_process
            try:
                results, seconds, cpu = retool_modes(helper, tokenizer, workload, args.max_len, args.runs)
            finally:
                # The engine core (its process with --engine-process, or the exit waits on it).
                helper.llm.llm_engine.engine_core.shutdown()
            part, ratio, walls = engine_summary("colocate_", results, seconds, cpu, workload)
            summary.update(part)
            print_engine("vLLM colocated (request-level API)", ratio, walls)
    if "same_outputs" in summary or "colocate_same_outputs" in summary:
        summary.setdefault("same_outputs", summary.get("colocate_same_outputs"))
        summary["same_outputs"] = bool(summary["same_outputs"] and summary.get("colocate_same_outputs", True))
    print(f"B={args.batch}, {args.runs} alternated runs per figure, same outputs: {summary.get('same_outputs')}")
    results_log.record("async_rollout", summary, run, enabled=not args.no_record)
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
