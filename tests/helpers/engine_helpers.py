"""Shared pieces of the engine tests (real vLLM engine, several processes): configs, prompts, a server launcher."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer, GenerationConfig

from helpers.testing_utils import reply_json
from retool_trl import ReToolConfig
from retool_trl.data.synthetic import make_arithmetic_dataset
from retool_trl.quickstart import model_path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "serve"))  # scripts/ is not a package: its modules import by folder
from vllm_serve import local_command  # noqa: E402 - stdlib-only at import: no vLLM needed to import the helpers

MAX_LEN = 64


def quickstart_tokenizer():
    return AutoTokenizer.from_pretrained(model_path())


def quickstart_dataset(n: int = 16, seed: int = 0):
    return make_arithmetic_dataset(n, seed=seed)


def engine_config(output_dir, **overrides) -> ReToolConfig:
    """The quickstart's settings, small: a few problems, short completions, one sandbox worker, float32 on CPU."""
    settings = dict(
        output_dir=str(output_dir),
        max_steps=2,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=MAX_LEN,
        max_tool_calls=2,
        max_interpreter_output_chars=64,
        system_prompt="none",
        sandbox_workers=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        vllm_max_model_length=512,
        seed=0,
        disable_tqdm=True,
    )
    return ReToolConfig(**{**settings, **overrides})


def greedy_generation_config(tokenizer) -> GenerationConfig:
    return GenerationConfig(do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class VLLMServer:
    """TRL's vLLM server (`scripts/serve/vllm_serve.py`) on 127.0.0.1, started and stopped by the caller (a
    fixture)."""

    def __init__(
        self, model: str, port: int | None = None, startup_timeout_s: float = 300.0, max_model_len: int = 512
    ):
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"retool_vllm_server_{self.port}.log"
        command = local_command(model, self.port, max_model_len=max_model_len)
        # The tests push weights by reload (`push_by_reload`) through this extension's method; `tests/` on the path
        # so that the engine's processes import it.
        command += ["--worker-extension-cls", "helpers.reload_worker.ReloadWorkerExtension"]
        path = os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        # Own process group: stop() ends the server and the engine core it spawns, nothing else.
        self.process = subprocess.Popen(
            command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": path},
        )
        self._wait_healthy(startup_timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"vLLM server exited with {self.process.returncode}; log: {self.log_path}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"vLLM server not healthy after {timeout_s:.0f} s; log: {self.log_path}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait(timeout=30)
        self._log.close()


def assert_same_rollout(ours, barrier, snippet_timeout: bool) -> None:
    """The async rollout `ours` equals the barrier loop's `barrier` (greedy): ids, masks, reward kwargs, log-probs;
    the workload really called code, and timed out exactly when `snippet_timeout`."""
    import torch

    assert sum(barrier.num_tool_calls) > 0
    assert (sum(barrier.num_tool_timeouts) > 0) == snippet_timeout
    assert not any(ours.infra_failed)
    assert ours.completion_ids == barrier.completion_ids
    assert ours.interpreter_mask == barrier.interpreter_mask
    assert ours.extra_fields() == barrier.extra_fields()  # the reward kwargs
    for a, b in zip(ours.logprobs, barrier.logprobs, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-3)


# ------------------------------------------------------------------------------------ proof of the weight sync
PROBE = "What is 12*34?\n<code>print(12*34)</code>"  # a fixed sequence whose log-probs stand for the weights
SYNC_TOLERANCE = 0.05  # vLLM's CPU kernels are not bit-identical to torch's: mean |difference| of log-probs below it


def vllm_prompt_logprobs(llm, ids):
    """Log-prob of each token of `ids` given the ones before, as the colocated engine's model computes it."""
    import torch
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    out = llm.generate([{"prompt_token_ids": ids}], sampling_params=params, use_tqdm=False)[0]
    return torch.tensor([out.prompt_logprobs[k][ids[k]].logprob for k in range(1, len(ids))])


def server_prompt_logprobs(client, ids):
    """The same, as a vLLM server's model computes it (TRL's `VLLMClient.get_sequence_logprobs`)."""
    import torch

    out = client.get_sequence_logprobs([ids], prompt_lengths=[1], top_logprobs=1)
    return torch.tensor([step[0] for step in out["actual_logprobs"][0]])


def policy_logprobs(model, ids):
    """The same under `model` in torch: a full forward of the trainer's own model, the independent truth."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def gap(a, b) -> float:
    """Mean absolute difference of two log-prob vectors."""
    return (a - b).abs().mean().item()


class WeightsNotSynced(AssertionError):
    """The engine's log-probs after a weight sync are not the trainer's current policy's."""


class SyncCheck:
    """Proof that each weight sync reached the engine: installed on TRL's helper (`after_each_sync`), after every
    `sync_weights` it computes the log-probs of a fixed probe on the engine (`engine_logprobs(ids)`) and under the
    trainer's model in torch, and raises `WeightsNotSynced` when they differ by more than `tolerance`. `records` keeps
    each sync's numbers: `gap` (engine vs policy), and from the second sync on `moved` (policy vs the policy at the
    previous sync: what training changed) and `stale` (engine vs the previous sync's policy)."""

    def __init__(self, model, engine_logprobs, tokenizer, tolerance: float = SYNC_TOLERANCE):
        self.model, self.engine_logprobs, self.tolerance = model, engine_logprobs, tolerance
        self.ids = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
        self.records: list[dict] = []
        self._previous = None

    def __call__(self) -> dict:
        policy, engine = policy_logprobs(self.model, self.ids), self.engine_logprobs(self.ids)
        record = {"gap": gap(engine, policy)}
        if self._previous is not None:
            record.update(moved=gap(policy, self._previous), stale=gap(engine, self._previous))
        self._previous = policy
        self.records.append(record)
        if record["gap"] > self.tolerance:
            raise WeightsNotSynced(
                f"sync {len(self.records)}: the engine's log-probs are {record['gap']:.3f} from the trainer's "
                f"policy (tolerance {self.tolerance}); {record}"
            )
        return record

    def after_each_sync(self, helper) -> SyncCheck:
        """Wraps `helper.sync_weights` (TRL's `VLLMGeneration`, as the trainer set it up) so the check runs after each
        sync the trainer makes."""
        sync = helper.sync_weights

        def sync_then_check():
            sync()
            self()

        helper.sync_weights = sync_then_check
        return self

    def moved_syncs(self) -> int:
        """How many syncs followed training that moved the probe's log-probs visibly (by three times the tolerance):
        the ones a skipped or stale sync could not have passed. A step whose completions all scored alike updates
        nothing, so the sync after it proves nothing."""
        return sum(r.get("moved", 0.0) > 3 * self.tolerance for r in self.records)


def push_by_reload(out_dir: Path, model_dir: str):
    """`VLLMClient.update_named_params` over vLLM's reload API instead of NCCL (which needs CUDA): the tensors TRL's
    `sync_weights` streams are written as a checkpoint and the server's workers reload from it (`/collective_rpc`
    `reload_weights_tied`, a `VLLMServer`'s worker extension: vLLM's `reload_weights`, then the tied LM head
    repacked). TRL's `sync_weights` itself (which process pushes, what it iterates, the prefix-cache reset after the
    push) runs unchanged."""
    import shutil

    from safetensors.torch import save_file

    def update_named_params(self, metadata, named_params):
        folder = Path(out_dir) / "pushed"
        folder.mkdir(exist_ok=True)
        save_file({name: t.detach().contiguous().clone() for name, t in named_params}, folder / "model.safetensors")
        shutil.copy(Path(model_dir) / "config.json", folder / "config.json")
        method = {"method": "reload_weights_tied", "kwargs": {"weights_path": str(folder)}}
        self._post(f"{self.base_url}/collective_rpc", json=method)

    return update_named_params


class RefusingProxy:
    """A proxy on 127.0.0.1 in front of a vLLM server, standing for a vLLM router: it refuses a prefix-cache reset
    while completions requests run (HTTP 409), and makes a weight push slow (`push_delay_s` before the reload is
    forwarded: the time a large model's weights take to stream). Records `events`: `("completions", t)` when a
    completions request arrives, `("push", t_start, t_done)`, `("reset", t, status)`."""

    def __init__(self, backend: str, push_delay_s: float = 3.0):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        outer = self
        self.backend, self.push_delay_s = backend.rstrip("/"), push_delay_s
        self.events, self.running, self.lock = [], 0, threading.Lock()
        self.client = httpx.Client(timeout=None)

        class Handler(BaseHTTPRequestHandler):  # HTTP/1.0: one request per connection, the reply ends at close
            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.forward(self, "GET", b"")

            def do_POST(self):
                outer.forward(self, "POST", self.rfile.read(int(self.headers.get("Content-Length") or 0)))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def forward(self, handler, method: str, body: bytes) -> None:
        path = handler.path
        if path.startswith("/reset_prefix_cache"):
            with self.lock:
                busy = self.running
                if busy:
                    self.events.append(("reset", time.monotonic(), 409))
            if busy:
                reply_json(handler, 409, {"error": {"message": f"{busy} requests are running", "code": 409}})
                return
        completions = path.startswith("/v1/completions")
        if completions:
            with self.lock:
                self.running += 1
                self.events.append(("completions", time.monotonic()))
        push = path.startswith("/collective_rpc")
        started = time.monotonic()
        if push:
            time.sleep(self.push_delay_s)
        headers = {"Content-Type": handler.headers.get("Content-Type", "application/json")}
        try:
            with self.client.stream(method, self.backend + path, content=body or None, headers=headers) as reply:
                handler.send_response(reply.status_code)
                handler.send_header("Content-Type", reply.headers.get("content-type", "application/json"))
                handler.end_headers()
                for chunk in reply.iter_raw():
                    handler.wfile.write(chunk)
                    handler.wfile.flush()
                status = reply.status_code
        finally:
            with self.lock:
                self.running -= completions
                if push:
                    self.events.append(("push", started, time.monotonic()))
        if path.startswith("/reset_prefix_cache"):
            with self.lock:
                self.events.append(("reset", time.monotonic(), status))

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.client.close()


def launch(mode: str, out_dir, nproc: int, *extra: str, timeout_s: float = 600) -> list[dict]:
    """Runs `tests/helpers/multiproc_worker.py` under torchrun; a hang fails the test at `timeout_s`, never blocks
    CI."""
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        str(REPO / "tests" / "helpers" / "multiproc_worker.py"),
        mode,
        str(out_dir),
        *extra,
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]
