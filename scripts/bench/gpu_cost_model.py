"""`bench_async_rollout.py --engine gpu-model`: the async and barrier loops against a *cost model* of a GPU engine.

No GPU here, and on a CPU the engine's step cost grows with the batch, which caps what async can win. This module
stands in for vLLM's colocated engine with one whose steps take the time a cost model of a real GPU engine gives,
behind the request-level API `ColocateEngine` drives (`add_request`, `step`, `abort_request`):

- a step decodes one token for every running request: `decode_s + decode_per_seq_s * batch` (nearly flat in the
  batch: decode is bound by streaming the weights), plus `prefill_per_token_s` for each new token scheduled in that
  step (a request's prompt, less the blocks vLLM's prefix cache holds: whole `block` blocks of the previous turn);
- before it, a host-side scheduling cost `host_s + host_per_seq_s * batch` that **holds the GIL** (vLLM's Python
  scheduler and output processing in a colocated trainer), spent busy in Python; the GPU time is slept (the GIL is
  free while a real engine waits for its kernels);
- the tokens are scripted (the straggler workload: long-tailed turn lengths, some turns hundreds of tokens), the
  snippets really run in the local sandbox and sleep long-tailed latencies (most tens of ms, some seconds, as
  sympy-heavy cells do).

The ideal schedules (`ideal_async`, `ideal_barrier`) replay the same requests and snippets through the same costs with
no loop at all: async lets each completion go at its own pace on the shared engine, the barrier waits every turn for
its slowest sequence and then its slowest snippet. A loop's wall over its ideal is its own overhead (the GIL, threads,
sandbox admission, the step's sleep overshoot, which is reported apart).
"""

from __future__ import annotations

import heapq
import random
import time
import types
from dataclasses import dataclass

from retool_trl.sandbox.base import SandboxWrapper


@dataclass(frozen=True)
class GpuCost:
    """Per-step costs of one engine. Sources and derivations: docs/performance.md, "Async vs barrier on a GPU cost
    model"."""

    name: str
    decode_s: float
    decode_per_seq_s: float
    prefill_per_token_s: float
    host_s: float
    host_per_seq_s: float
    block: int = 16

    def gpu_step_s(self, batch: int, prefill_tokens: int) -> float:
        return self.decode_s + self.decode_per_seq_s * batch + self.prefill_per_token_s * prefill_tokens

    def host_step_s(self, batch: int) -> float:
        return self.host_s + self.host_per_seq_s * batch

    def step_s(self, batch: int, prefill_tokens: int) -> float:
        return self.host_step_s(batch) + self.gpu_step_s(batch, prefill_tokens)


# Decode: bf16 weights streamed once per step at 77% of the HBM bandwidth (H100 SXM 3.35 TB/s, H200 4.8 TB/s);
# per sequence, its KV cache read (a few MB at these context lengths). Prefill: 2 FLOPs per parameter and token at
# 40% of 989 dense bf16 TFLOP/s. Host: vLLM's scheduling and output processing per step, in Python.
MODELS = {
    "qwen2.5-1.5b-h100": GpuCost("qwen2.5-1.5b-h100", 1.2e-3, 4e-6, 7.8e-6, 0.4e-3, 8e-6),
    "qwen2.5-7b-h200": GpuCost("qwen2.5-7b-h200", 4.1e-3, 8e-6, 38e-6, 0.4e-3, 8e-6),
}


def gpu_workload(batch: int, seed: int, scale: float = 1.0) -> list[dict]:
    """Per completion: a prompt, its scripted turns (2-4 code turns, then an answer) and its snippets' latencies.

    Turn lengths are long-tailed and drawn per turn: most 20-120 words before the cell, one in five 300-600. Snippet
    latencies too: 70% 5-50 ms, 22% 0.1-0.5 s, 8% 1-3 s (sympy-heavy cells). `scale` shrinks both (tests)."""
    rng = random.Random(f"gpu-model {seed}")
    rows = []
    for i in range(batch):
        calls = rng.choice((2, 3, 4))
        turns = []
        for _ in range(calls):
            words = rng.randint(300, 600) if rng.random() < 0.2 else rng.randint(20, 120)
            turns.append("step " * round(words * scale) + f"<code>work({i})</code>")
        turns.append("So the answer is \\boxed{" + str(i % 10) + "}.")
        latencies = []
        for _ in range(calls):
            u = rng.random()
            latency = (
                rng.uniform(1.0, 3.0) if u < 0.08 else rng.uniform(0.1, 0.5) if u < 0.30 else rng.uniform(0.005, 0.05)
            )
            latencies.append(latency * scale)
        # Completion i's cells name it (`work(i)`), so its latencies follow it whatever order the sessions start in.
        rows.append({"prompt": f"Problem {i:03d}:", "turns": turns, "latencies": latencies})
    return rows


class _Request:
    __slots__ = ("id", "key", "tokens", "emitted", "prefill", "prompt_len", "cut")

    def __init__(self, request_id, key, tokens, prefill, prompt_len, cut=False):
        self.id, self.key, self.tokens, self.emitted = request_id, key, tokens, 0
        self.prefill, self.prompt_len, self.cut = prefill, prompt_len, cut


class ModelEngine:
    """vLLM's `LLMEngine` request API over the cost model: `add_request`, `step`, `abort_request`.

    Each completion (found by its prompt's first `key_len` tokens) gets its scripted turns in order: the turn's
    tokens (the answer turn ends with EOS), cut at the request's `max_tokens`. Every request is logged, per
    completion, with the tokens it prefilled and decoded, for the ideal schedules."""

    def __init__(self, cost: GpuCost, scripts: dict, tokenizer, key_len: int):
        self.cost, self.key_len = cost, key_len
        eos = tokenizer.eos_token_id
        self.scripts = {
            key: [tokenizer(t, add_special_tokens=False)["input_ids"] for t in turns[:-1]]
            + [tokenizer(turns[-1], add_special_tokens=False)["input_ids"] + [eos]]
            for key, turns in scripts.items()
        }
        self.turn: dict = {}
        self.cached: dict = {}  # completion -> its last request's tokens (prompt + output): the prefix cache
        self.running: list[_Request] = []
        self.log: dict = {}  # completion -> [(prefill tokens, decoded tokens), ...]
        self.steps, self.gpu_s, self.slept_s, self.host_busy_s = 0, 0.0, 0.0, 0.0
        self.gaps_s, self.last_end = 0.0, None  # time between steps: the loop's own work, and idle waits
        self.batch_sum = 0

    def add_request(self, request_id, prompt, params):
        ids = list(prompt["prompt_token_ids"])
        key = tuple(ids[: self.key_len])
        turn = self.turn.get(key, 0)
        self.turn[key] = turn + 1
        script = self.scripts[key]
        scripted = script[turn] if turn < len(script) else [self.scripts[key][-1][-1]]
        tokens = scripted[: params.max_tokens]
        prefill = len(ids) - prefix_cached(self.cached.get(key, ()), ids, self.cost.block)
        self.running.append(_Request(request_id, key, tokens, prefill, len(ids), cut=len(scripted) > len(tokens)))
        self.cached[key] = ids + tokens
        self.log.setdefault(key, []).append((prefill, len(tokens)))

    def abort_request(self, request_ids):
        gone = set([request_ids] if isinstance(request_ids, str) else request_ids)
        self.running = [r for r in self.running if r.id not in gone]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self):
        batch = len(self.running)
        if not batch:
            return []
        prefill = sum(r.prefill for r in self.running if r.emitted == 0)
        host = self.cost.host_step_s(batch)
        start = time.perf_counter()
        if self.last_end is not None:
            self.gaps_s += start - self.last_end
        self.batch_sum += batch
        while time.perf_counter() - start < host:  # Python busy in the scheduler: the GIL is held
            pass
        self.host_busy_s += time.perf_counter() - start
        gpu = self.cost.gpu_step_s(batch, prefill)
        start = time.perf_counter()
        time.sleep(gpu)  # the kernels run; the host thread waits with the GIL released
        self.slept_s += time.perf_counter() - start
        self.gpu_s += gpu
        self.steps += 1
        finished, still = [], []
        for r in self.running:
            r.emitted += 1
            if r.emitted >= len(r.tokens):
                # As vLLM reports it: "length" when the turn was cut at its budget, "stop" otherwise.
                reason = "length" if r.cut else "stop"
                completion = types.SimpleNamespace(token_ids=list(r.tokens), logprobs=None, finish_reason=reason)
                finished.append(types.SimpleNamespace(request_id=r.id, finished=True, outputs=[completion]))
            else:
                still.append(r)
        self.running = still
        self.last_end = time.perf_counter()
        return finished


def prefix_cached(previous, ids, block: int) -> int:
    """Tokens of `ids` vLLM's prefix cache holds after the previous request of the same completion: their common
    prefix, in whole blocks (the last, partly filled block is prefilled again)."""
    common = 0
    for a, b in zip(previous, ids):
        if a != b:
            break
        common += 1
    return common // block * block


def helper_for(engine: ModelEngine):
    """The attributes of TRL's colocate helper that `ColocateEngine` reads, around the model engine."""
    return types.SimpleNamespace(
        mode="colocate",
        llm=types.SimpleNamespace(llm_engine=engine),
        tensor_parallel_size=1,
        generation_kwargs={},
        enable_sleep_mode=False,
    )


# ------------------------------------------------------------------------------------------------ ideal schedules
def ideal_async(log: dict, latencies: dict, cost: GpuCost) -> float:
    """The async loop with no overhead: each completion's requests join the shared engine the moment its previous
    snippet ends (continuous batching, one token per running request per step), its snippets run at once."""
    pending = {key: list(reqs) for key, reqs in log.items()}
    snippets = {key: list(latencies[key]) for key in log}
    now, running, arrivals = 0.0, {}, [(0.0, key) for key in pending]  # running: key -> tokens left
    heapq.heapify(arrivals)
    fresh: dict = {}
    while running or arrivals:
        if not running:
            now = max(now, arrivals[0][0])
        while arrivals and arrivals[0][0] <= now:
            _, key = heapq.heappop(arrivals)
            prefill, tokens = pending[key].pop(0)
            running[key], fresh[key] = tokens, prefill
        now += cost.step_s(len(running), sum(fresh.values()))
        fresh = {}
        for key in list(running):
            running[key] -= 1
            if running[key] <= 0:
                del running[key]
                if pending[key]:
                    heapq.heappush(arrivals, (now + (snippets[key].pop(0) if snippets[key] else 0.0), key))
    return now


def ideal_barrier(log: dict, latencies: dict, cost: GpuCost) -> float:
    """The barrier with no overhead: every round sends each active completion's request at once, waits for the
    longest, then for the slowest snippet of the round."""
    now, rounds = 0.0, max(len(reqs) for reqs in log.values())
    for k in range(rounds):
        active = {key: reqs[k] for key, reqs in log.items() if k < len(reqs)}
        left = {key: tokens for key, (_, tokens) in active.items()}
        prefill = sum(p for p, _ in active.values())
        while left:
            now += cost.step_s(len(left), prefill)
            prefill = 0
            left = {key: n - 1 for key, n in left.items() if n > 1}
        waits = [latencies[key][k] for key in active if k < len(latencies[key]) and k + 1 < len(log[key])]
        now += max(waits, default=0.0)
    return now


# ------------------------------------------------------------------------------------------------------ the run
class CompletionLatencies(SandboxWrapper):
    """The real sandbox, each `work(i)` cell sleeping completion i's next latency (its k-th call, the k-th)."""

    def __init__(self, inner, workload):
        super().__init__(inner)
        self.latencies, self.calls = [row["latencies"] for row in workload], {}

    def run_many(self, pairs):
        from bench_async_parts import sleep_cells

        return self.sandbox.run_many(sleep_cells(pairs, self.latency))

    def latency(self, session, i: int) -> tuple[float, int]:
        """The latency of `session`'s next call (completion `i`'s k-th) and k."""
        k = self.calls.get(id(session), 0)
        self.calls[id(session)] = k + 1
        return self.latencies[i][k], k


def _spread(values) -> dict:
    import statistics

    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_gpu_model(model: str, batch: int, seed: int, runs: int, scale: float = 1.0, verbose: bool = True) -> dict:
    """Barrier and async, alternated `runs` times (after one untimed round of each), against the model engine."""
    from bench_async_parts import BarrierOverEngine
    from transformers import AutoTokenizer

    from retool_trl.quickstart import model_path
    from retool_trl.rollout import RolloutSpec, interleaved_rollout
    from retool_trl.rollout.engines.vllm_colocate import ColocateEngine
    from retool_trl.rollout.per_completion import async_rollout
    from retool_trl.sandbox import LocalSandbox

    class ModelColocateEngine(ColocateEngine):
        def sampling_params(self, max_tokens, stop_at_code_end):  # read by the model engine: the turn's budget
            return types.SimpleNamespace(max_tokens=max_tokens, stop_at_code_end=stop_at_code_end)

    cost = MODELS[model]
    tokenizer = AutoTokenizer.from_pretrained(model_path())
    workload = gpu_workload(batch, seed, scale)
    prompts = [tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] for row in workload]
    key_len = len(prompts[0])
    assert len({tuple(p) for p in prompts}) == len(prompts) and {len(p) for p in prompts} == {key_len}
    scripts = {tuple(p): row["turns"] for p, row in zip(prompts, workload)}
    latencies = {tuple(p): row["latencies"] for p, row in zip(prompts, workload)}
    spec = RolloutSpec(
        max_completion_length=16384,
        eos_token_ids=[tokenizer.eos_token_id],
        max_tool_calls=4,
        max_interpreter_output_chars=256,
    )
    walls, ideals, overshoot, results, steps, gaps = {"barrier": [], "async": []}, {}, {}, {}, {}, {}
    with LocalSandbox(num_workers=2, timeout_s=10.0) as box:
        box.session().run("print(1)")  # the zygote is up before the clock starts
        for k, mode in enumerate(("barrier", "async") * (runs + 1)):
            engine = ModelEngine(cost, scripts, tokenizer, key_len)
            turns = ModelColocateEngine(helper_for(engine), tokenizer, "</code>")
            sandbox = CompletionLatencies(box, workload)
            started = time.perf_counter()
            if mode == "async":
                result = async_rollout(prompts, turns, sandbox, tokenizer, spec, max_concurrency=len(prompts))
            else:
                backend = BarrierOverEngine(turns)
                try:
                    result = interleaved_rollout(prompts, backend, sandbox, tokenizer, spec)
                finally:
                    backend.close()
            wall = time.perf_counter() - started
            results[mode] = result
            ideal = (ideal_async if mode == "async" else ideal_barrier)(engine.log, latencies, cost)
            ideals.setdefault(mode, []).append(ideal)
            overshoot.setdefault(mode, []).append(engine.slept_s - engine.gpu_s)
            steps[mode] = engine.steps
            if k >= 2:
                gaps.setdefault(mode, []).append(engine.gaps_s)
            if k >= 2 and verbose:
                print(
                    f"  [{mode}] wall {wall:.2f} s, ideal {ideal:.2f} s; engine: host {engine.host_busy_s:.2f} s, "
                    f"GPU slept {engine.slept_s:.2f} s (model {engine.gpu_s:.2f} s), between steps "
                    f"{engine.gaps_s:.2f} s, {engine.steps} steps, mean batch {engine.batch_sum / engine.steps:.1f}"
                )
            if k >= 2:
                walls[mode].append(wall)
    a, b = results["async"], results["barrier"]
    same = a.completion_ids == b.completion_ids and a.interpreter_mask == b.interpreter_mask
    ideal_a, ideal_b = ideals["async"][-1], ideals["barrier"][-1]
    vs_barrier = _spread([bw / aw for bw, aw in zip(walls["barrier"], walls["async"])])
    vs_ideal_a = _spread([w / ideal_a for w in walls["async"]])
    vs_ideal_b = _spread([w / ideal_b for w in walls["barrier"]])
    out = {"gpu_model": cost.name, "gpu_model_batch": batch, "gpu_model_runs": runs}
    for name, s in (
        ("async_vs_barrier", vs_barrier),
        ("async_vs_ideal", vs_ideal_a),
        ("barrier_vs_ideal", vs_ideal_b),
    ):
        out[f"gpu_model_{name}"], out[f"gpu_model_{name}_min"], out[f"gpu_model_{name}_max"] = (
            s["median"],
            s["min"],
            s["max"],
        )
    out.update(
        gpu_model_ideal_async_vs_barrier=ideal_b / ideal_a,
        gpu_model_async_seconds=_spread(walls["async"])["median"],
        gpu_model_barrier_seconds=_spread(walls["barrier"])["median"],
        gpu_model_ideal_async_seconds=ideal_a,
        gpu_model_ideal_barrier_seconds=ideal_b,
        gpu_model_sleep_overshoot_async_s=_spread(overshoot["async"])["median"],
        gpu_model_sleep_overshoot_barrier_s=_spread(overshoot["barrier"])["median"],
        gpu_model_between_steps_async_s=_spread(gaps["async"])["median"],
        gpu_model_between_steps_barrier_s=_spread(gaps["barrier"])["median"],
        gpu_model_engine_steps_async=steps["async"],
        gpu_model_engine_steps_barrier=steps["barrier"],
        gpu_model_same_outputs=same,
        gpu_model_tokens=sum(len(ids) for ids in a.completion_ids),
        gpu_model_sampled_tokens=sum(sum(m) for m in a.interpreter_mask),
        gpu_model_calls=sum(a.num_tool_calls),
        gpu_model_snippet_seconds_total=sum(sum(row["latencies"]) for row in workload),
        gpu_model_cost=dict(vars(cost)),
    )
    return out
