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
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        # Own process group: stop() ends the server and the engine core it spawns, nothing else.
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
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
