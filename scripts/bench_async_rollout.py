"""Async vs barrier rollout, and ReTool vs TRL's own `tools=` loop, on a real vLLM engine (server and colocated).

A straggler workload, as real runs have: B completions, each with 2-4 code calls, turns of different lengths and
long-tailed snippet latencies (most a few ms, some 100-300 ms; the snippets really sleep, in the local sandbox).
The policy text is forced with vLLM's structured outputs (a regex per turn), so every mode runs the same tokens through
the same engine. The regex fixes the text, not its tokens: greedy decoding picks the tokenization, so `same_outputs`
(identical token ids, masks and reward kwargs) checks that both modes sample from identical contexts.

1. barrier: `interleaved_rollout` whose turns send every active sequence's request at once and wait for all, then
   run all snippets at once and wait for all (the barrier of today's loop, with the same requests);
2. async: `async_rollout`, each completion its own loop;
3. TRL (server only): `GRPOTrainer(tools=[work])._generate` with the same server, a tiny model given TRL's bundled
   Qwen3 tool-calling chat template and its special tokens, every turn forced to one tool call: the same number of
   calls per completion and the same latencies, in TRL's loop.

`--engine server` runs them against TRL's vLLM server, `--engine colocate` against a vLLM `LLM` in this process driven
request by request (as `vllm_mode: colocate` does), `--engine both` (the default) one after the other. Each figure is
the median over `--runs` (at least 3) alternated runs, printed with its min-max; the JSON carries all three.

Run with the engines' environment (`bash scripts/test_engines.sh` builds it):

    .venv-engines/bin/python scripts/bench_async_rollout.py [--engine both] [--batch 32] [--runs 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import statistics  # noqa: E402

import httpx  # noqa: E402

from retool_trl.async_rollout import CompletionsEngine, async_rollout  # noqa: E402
from retool_trl.colocate_engine import ColocateEngine  # noqa: E402
from retool_trl.rollout import RolloutSpec, interleaved_rollout  # noqa: E402
from retool_trl.sandbox import LocalSandbox  # noqa: E402

CALLS = (2, 3, 4)
TOOL_CALL = '<tool_call>\n{"name": "work", "arguments": {}}\n</tool_call>'


# ----------------------------------------------------------------------------------------------------- the model
def build_model(path: Path):
    """A tiny random Qwen2 (head size 64: vLLM's CPU attention kernels need one of their supported sizes) whose
    tokenizer is the quickstart's byte-level BPE plus the Qwen3 chat template (TRL's bundled copy, which TRL's tool
    loop knows how to parse) and that template's special tokens."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    from trl.chat_template_utils import qwen3_chat_template

    from retool_trl.quickstart import model_path

    tokenizer = AutoTokenizer.from_pretrained(model_path())
    specials = [
        "<|im_start|>",
        "<|im_end|>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
    ]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = qwen3_chat_template
    tokenizer.eos_token = "<|im_end|>"
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer


class Server:
    """TRL's vLLM server for this CPU build (`scripts/vllm_serve.py`) on 127.0.0.1, in its own process group."""

    def __init__(self, model: Path, log: Path):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            str(Path(__file__).with_name("vllm_serve.py")),
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--enforce_eager",
            "--max_model_len",
            "2048",
        ]
        self.log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the vLLM server exited; see {log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(1)
        self.stop()
        raise TimeoutError(f"the vLLM server did not start; see {log}")

    def stop(self):
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            self.process.wait(timeout=60)
        self.log.close()


# ----------------------------------------------------------------------------------------------------- the workload
def make_workload(batch: int, seed: int, calls: int | None = None, prose: bool = True):
    """Per completion: a prompt, its forced turns and the latencies of its calls (2-4 calls per completion, or `calls`
    each).

    A completion's code turns are one text, repeated (some prose, then `<code>work(i)</code>`), and its last turn is
    the answer: so each completion forces just two distinct regexes, which vLLM compiles once and caches, rather than
    a new one per turn (compiling is engine time that is not the rollout's). The sandbox side (`Latencies`) turns the
    k-th `work(i)` of completion i into a cell that really sleeps its latency. Without prose (the comparison with
    TRL's loop), a code turn has a fixed sentence before its cell, so that it is as long as the tool call TRL's loop
    is forced to write (`TOOL_CALL`), and the answer is short."""
    rng = random.Random(seed)
    rows = []
    for i in range(batch):
        n_calls = calls or CALLS[i % len(CALLS)]
        latencies = [
            rng.uniform(0.1, 0.3) if rng.random() < 0.15 else rng.uniform(0.002, 0.01) for _ in range(n_calls)
        ]
        cell = f"<code>work({i})</code>"
        if prose:
            code_turn = "Let me check this part " * rng.randint(0, 6) + cell
        else:
            code_turn = "I call the tool for this piece now." + cell  # as many characters as TOOL_CALL
        # The last turn: an answer of varying length, which the regex ends with EOS.
        answer = (
            "So " + "the checks agree and " * (rng.randint(0, 3) if prose else 0) + f"the answer is \\boxed{{{i}}}."
        )
        rows.append({"prompt": f"Problem {i:03d}:", "turns": [code_turn] * n_calls + [answer], "latencies": latencies})
    return rows


class Latencies:
    """The real sandbox, with `work(i)` (the k-th call of completion i) run as a cell that sleeps that call's
    latency and prints k."""

    def __init__(self, inner, workload):
        self.inner, self.workload = inner, workload
        self.calls: dict = {}
        self.lock = threading.Lock()

    def session(self):
        return self.inner.session()

    def run_many(self, pairs):
        cells = []
        for session, code in pairs:
            row = int(re.fullmatch(r"work\((\d+)\)", code.strip()).group(1))
            with self.lock:
                k = self.calls[id(session)] = self.calls.get(id(session), -1) + 1
            cells.append((session, f"import time\ntime.sleep({self.workload[row]['latencies'][k]:.4f})\nprint({k})"))
        return self.inner.run_many(cells)


class ForcedEngine(CompletionsEngine):
    """The completions engine, with each sequence's next scripted turn forced by a regex (greedy); once a sequence
    has used its script, the model writes on its own."""

    def __init__(self, *args, scripts: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.scripts = scripts  # prompt ids (tuple) -> list of turn texts
        self.turns: dict = {}
        self.key_len = len(next(iter(scripts)))

    def request_fields(self, token_ids):
        key = tuple(token_ids[: self.key_len])
        turn = self.turns.get(key, 0)
        self.turns[key] = turn + 1
        script = self.scripts[key]
        return {"structured_outputs": {"regex": re.escape(script[turn])}} if turn < len(script) else {}


class ForcedColocateEngine(ColocateEngine):
    """The colocated engine, with each sequence's next scripted turn forced by a regex, as `ForcedEngine`."""

    def __init__(self, *args, scripts: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.scripts, self.turns, self.regex = scripts, {}, None
        self.key_len = len(next(iter(scripts)))

    async def generate(self, token_ids, max_tokens, stop_at_code_end):
        key = tuple(token_ids[: self.key_len])
        turn = self.turns.get(key, 0)
        self.turns[key] = turn + 1
        script = self.scripts[key]
        # Read by `sampling_params`, which the parent calls before its first await (one coroutine runs at a time).
        self.regex = re.escape(script[turn]) if turn < len(script) else None
        return await super().generate(token_ids, max_tokens, stop_at_code_end)

    def sampling_params(self, max_tokens, stop_at_code_end):
        from vllm.sampling_params import StructuredOutputsParams

        params = super().sampling_params(max_tokens, stop_at_code_end)
        if self.regex is not None:
            params.structured_outputs = StructuredOutputsParams(regex=self.regex)
        return params


def colocated_llm(model_dir: Path):
    """A vLLM `LLM` in this process with TRL's colocate settings, and the attributes of TRL's helper the colocate
    engine reads (greedy)."""
    import types

    from vllm import LLM

    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        max_num_batched_tokens=4096,
        logprobs_mode="processed_logprobs",
        seed=0,
    )
    return types.SimpleNamespace(
        mode="colocate",
        llm=llm,
        tensor_parallel_size=1,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        repetition_penalty=1.0,
        logprobs=0,
        generation_kwargs={},
        structured_outputs_regex=None,
        enable_sleep_mode=False,
    )


def spread(values) -> dict:
    """Median and min-max of a list of figures."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


class BarrierOverEngine:
    """Today's barrier, with the same requests: a turn sends every active sequence's request at once and returns
    when the last one is back (the rollout then runs every snippet at once and waits for the last)."""

    def __init__(self, engine):
        self.engine, self.loop = engine, asyncio.new_event_loop()
        self.loop.run_until_complete(engine.__aenter__())

    def generate_turn(self, sequences, max_new_tokens, stop_at_code_end):
        async def all_rows():
            return await asyncio.gather(
                *(
                    self.engine.generate(list(s), n, stop)
                    for s, n, stop in zip(sequences, max_new_tokens, stop_at_code_end)
                )
            )

        return self.loop.run_until_complete(all_rows())

    def close(self):
        self.loop.run_until_complete(self.engine.__aexit__(None, None, None))
        self.loop.close()


def retool_modes(target, tokenizer, workload, max_len, runs):
    """Barrier and async, alternated `runs` times, against `target`: a server URL or a colocated helper."""
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

    results, seconds, client_cpu = {}, {"barrier": [], "async": []}, {"barrier": [], "async": []}
    with LocalSandbox(num_workers=2, timeout_s=5.0) as box:
        box.session().run("print(1)")  # the zygote is up before the clock starts
        # One untimed pair first (compiling the regexes, warming the caches), then alternated timed runs, so that a
        # load change hits both modes alike.
        for k, mode in enumerate(("barrier", "async") * (runs + 1)):
            sandbox = Latencies(box, workload)
            started, cpu = time.perf_counter(), time.process_time()
            if mode == "async":
                result = async_rollout(prompts, engine(), sandbox, tokenizer, spec, max_concurrency=len(prompts))
            else:
                backend = BarrierOverEngine(engine())
                try:
                    result = interleaved_rollout(prompts, backend, sandbox, tokenizer, spec)
                finally:
                    backend.close()
            results[mode] = result
            if k < 2:
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


def engine_summary(prefix, results, seconds, client_cpu, workload) -> dict:
    """Per-run ratios barrier/async (one per alternated pair): median and min-max, with the wall times."""
    ratios = [b / a for b, a in zip(seconds["barrier"], seconds["async"], strict=True)]
    ratio = spread(ratios)
    summary = {
        f"{prefix}async_vs_barrier": ratio["median"],
        f"{prefix}async_vs_barrier_min": ratio["min"],
        f"{prefix}async_vs_barrier_max": ratio["max"],
        f"{prefix}same_outputs": same_outputs(results),
        f"{prefix}barrier_seconds": statistics.median(seconds["barrier"]),
        f"{prefix}async_seconds": statistics.median(seconds["async"]),
        f"{prefix}client_cpu_seconds_async": statistics.median(client_cpu["async"]),
        f"{prefix}client_cpu_seconds_barrier": statistics.median(client_cpu["barrier"]),
        f"{prefix}engine_requests": results["async"].engine_calls[0],
        f"{prefix}calls": sum(results["async"].num_tool_calls),
        f"{prefix}tokens": sum(len(ids) for ids in results["async"].completion_ids),
        f"{prefix}snippet_seconds_total": sum(sum(row["latencies"]) for row in workload),
    }
    return summary, ratio, {mode: spread(values) for mode, values in seconds.items()}


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
        ours, seconds, _ = retool_modes(url, tokenizer, fixed, max_len, runs=1)
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


def print_engine(title, ratio, walls):
    print(f"{title}: barrier/async {ratio['median']:.2f} (min {ratio['min']:.2f}, max {ratio['max']:.2f})")
    for mode in ("barrier", "async"):
        w = walls[mode]
        print(f"  {mode:<8} wall s: median {w['median']:.2f} (min {w['min']:.2f}, max {w['max']:.2f})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", choices=("both", "server", "colocate"), default="both")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=3, help="Alternated runs per figure (at least 3).")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--skip-trl", action="store_true", help="Skip TRL's tools= loop.")
    args = parser.parse_args()
    if args.runs < 3:
        parser.error("--runs must be at least 3: one run cannot tell a change from noise")

    summary = {"batch": args.batch, "runs": args.runs}
    workload = make_workload(args.batch, args.seed)
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
            helper = colocated_llm(model_dir)
            try:
                results, seconds, cpu = retool_modes(helper, tokenizer, workload, args.max_len, args.runs)
            finally:
                helper.llm.llm_engine.engine_core.shutdown()  # its engine-core process, or the exit waits on it
            part, ratio, walls = engine_summary("colocate_", results, seconds, cpu, workload)
            summary.update(part)
            print_engine("vLLM colocated (request-level API)", ratio, walls)
    if "same_outputs" in summary or "colocate_same_outputs" in summary:
        summary.setdefault("same_outputs", summary.get("colocate_same_outputs"))
        summary["same_outputs"] = bool(summary["same_outputs"] and summary.get("colocate_same_outputs", True))
    print(f"B={args.batch}, {args.runs} alternated runs per figure, same outputs: {summary.get('same_outputs')}")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
