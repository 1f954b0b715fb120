"""The pieces of `bench_async_rollout.py`: the model, the vLLM server, the straggler workload, the forced engines.

Run the benchmark itself (`scripts/bench_async_rollout.py`, which runs `scripts/bench/bench_async_rollout.py`); this
module is imported from it.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))  # vllm_serve.py, the server users run
from vllm_serve import local_command  # noqa: E402

from retool_trl.rollout.engines.vllm_colocate import ColocateEngine
from retool_trl.rollout.per_completion import CompletionsEngine
from retool_trl.sandbox.base import SandboxWrapper

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
    """TRL's vLLM server for this CPU build (`scripts/serve/vllm_serve.py`) on 127.0.0.1, in its own process group."""

    def __init__(self, model: Path, log: Path):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        command = local_command(model, self.port, max_model_len=2048)
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
def make_workload(
    batch: int, seed: int, calls: int | None = None, prose: bool = True, kinds: int = 6, turns: str = "long-tailed"
):
    """Per completion: a prompt, its forced turns, and the latencies of its calls.

    Completions come in `kinds` kinds (without prose, one): a kind fixes the text, i.e. how many calls (2-4, or
    `calls`), the prose before each cell, the cell `<code>work(kind)</code>` and the answer (0-3 sentences); its
    completions differ by prompt and by the latencies of their calls (long-tailed: most a few ms, some 100-300 ms).

    The prose before each cell is drawn per kind and per turn. `turns="long-tailed"` (the default, as in real
    multi-turn reasoning, where a turn may think for a paragraph or go straight to code): most turns 0-2 sentences,
    one in five 10-14 sentences, drawn independently per turn, so the longest turn of each round is usually another
    completion's. `turns="even"`: one length (0-6 sentences) for all the code turns of a kind (the workload before
    turn lengths were drawn per turn), so a per-turn barrier mostly waits on the same long completion. Both give the
    same answers and snippet latencies for a seed.

    Completions of a kind share their regexes, which matters twice: vLLM compiles each regex once and caches it
    (compiling is engine time that is not the rollout's), and the server engine coalesces only requests with the same
    sampling fields (in training every completion has the same; the forcing regex is this benchmark's artefact, so it
    coalesces less than training would). The sandbox side (`Latencies`) turns each `work(kind)` into a cell that
    really sleeps. Without prose (the comparison with TRL's loop), a code turn has a fixed sentence before its cell,
    about as long as the tool call TRL's loop is forced to write (`TOOL_CALL`), and the answer is short."""
    if turns not in ("long-tailed", "even"):
        raise ValueError(f"turns must be 'long-tailed' or 'even', got {turns!r}")
    if kinds < 1:
        raise ValueError(f"kinds must be at least 1, got {kinds}")
    rng = random.Random(seed)
    # The long-tailed lengths come from a generator of their own, so that both `turns` give the same answers and
    # snippet latencies for a seed: only the code turns' lengths differ between them.
    lengths = random.Random(f"turn lengths {seed}")
    texts = []
    for kind in range(1 if not prose else min(kinds, batch)):
        n_calls = calls or CALLS[kind % len(CALLS)]
        cell = f"<code>work({kind})</code>"
        if not prose:
            code_turns = ["I call the tool for this piece now, to see." + cell] * n_calls  # about as long as TOOL_CALL
        else:
            even = rng.randint(0, 6)
            sentences = (
                [even] * n_calls
                if turns == "even"
                else [
                    lengths.randint(10, 14) if lengths.random() < 0.2 else lengths.randint(0, 2)
                    for _ in range(n_calls)
                ]
            )
            code_turns = ["Let me check this part " * n + cell for n in sentences]
        extra = rng.randint(0, 3) if prose else 0
        # The last turn: an answer, which the regex ends with EOS.
        answer = "So " + "the checks agree and " * extra + f"the answer is \\boxed{{{extra}}}."
        texts.append([*code_turns, answer])
    rows = []
    for i in range(batch):
        kind = i % len(texts)
        latencies = [
            rng.uniform(0.1, 0.3) if rng.random() < 0.15 else rng.uniform(0.002, 0.01)
            for _ in range(len(texts[kind]) - 1)
        ]
        rows.append({"prompt": f"Problem {i:03d}:", "turns": texts[kind], "latencies": latencies, "kind": kind})
    return rows


class Latencies(SandboxWrapper):
    """The real sandbox, with `work(kind)` run as a cell that sleeps a latency and prints the call's number k.

    The k-th call of a session sleeps the k-th latency of a completion of that kind: the n-th session of a kind to
    run a cell gets the n-th completion of that kind. Completions of a kind write the same text, so however the
    sessions are ordered, every mode gets the same completions with the same latencies."""

    def __init__(self, inner, workload):
        super().__init__(inner)
        self.of_kind: dict = {}
        for row in workload:
            self.of_kind.setdefault(row["kind"], []).append(row["latencies"])
        self.started = dict.fromkeys(self.of_kind, 0)  # sessions of each kind so far
        self.sessions: dict = {}  # id(session) -> [latencies, calls so far]
        self.lock = threading.Lock()

    def run_many(self, pairs):
        return self.sandbox.run_many(sleep_cells(pairs, self.latency))

    def latency(self, session, kind: int) -> tuple[float, int]:
        """The latency of `session`'s next call and that call's number k."""
        with self.lock:
            if id(session) not in self.sessions:
                self.sessions[id(session)] = [self.of_kind[kind][self.started[kind]], 0]
                self.started[kind] += 1
            latencies, k = self.sessions[id(session)]
            self.sessions[id(session)][1] += 1
        return latencies[k], k


def sleep_cells(pairs, latency) -> list:
    """The cells really run for the workload's `work(n)` calls (`Latencies` here, `CompletionLatencies` of the GPU
    cost model): each sleeps the seconds `latency(session, n)` gives and prints the call's number k, which it gives
    too (it counts the session's calls)."""
    cells = []
    for session, code in pairs:
        seconds, k = latency(session, int(re.fullmatch(r"work\((\d+)\)", code.strip()).group(1)))
        cells.append((session, f"import time\ntime.sleep({seconds:.4f})\nprint({k})"))
    return cells


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


def colocated_llm(model_dir: Path, in_process: bool = True):
    """A vLLM `LLM` in this process with TRL's colocate settings, and the attributes of TRL's helper the colocate
    engine reads (greedy).

    As TRL builds it (`distributed_executor_backend="external_launcher"`, rank 0 of 1), the engine runs in this
    process: `llm_engine.step()` schedules, runs the model and samples on the calling thread, beside the rollout's
    snippet threads. `in_process=False` gives vLLM's default instead (the engine core in a process of its own), which
    TRL's colocate mode does not use."""
    import types

    from trl.trainer.utils import ensure_master_addr_port
    from vllm import LLM

    kwargs = {}
    if in_process:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        ensure_master_addr_port()
        kwargs["distributed_executor_backend"] = "external_launcher"
    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        max_num_batched_tokens=4096,
        logprobs_mode="processed_logprobs",
        seed=0,
        **kwargs,
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
