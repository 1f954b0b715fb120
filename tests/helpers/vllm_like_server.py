"""A stand-in for vLLM's OpenAI server on 127.0.0.1, applying vLLM's own request checks, for tests without vLLM.

What it does as vLLM 0.32 does (read from `vllm/entrypoints/openai/completion/*`, `renderers/params.py`,
`entrypoints/serve/utils/api_utils.py`):

- `GET /v1/models`: the model card, with `max_model_len`;
- `POST /v1/completions` with one or a list of token-id prompts and one `max_tokens`: each prompt is checked against
  `max_model_len - max_tokens` and the whole request is refused with HTTP 400 and vLLM's message when one does not
  fit; otherwise every prompt is continued (not streamed: one JSON reply, choices in prompt order, each with
  `prompt_token_ids`, `token_ids`, `finish_reason` and `logprobs` in the completions format TRL's client parses;
  streamed: SSE chunks, one choice per chunk, then `[DONE]`), stopping at a stop string (kept, with
  `include_stop_str_in_output`), a stop token id, EOS, the budget or the context limit;
- `POST /reset_prefix_cache`: refused with HTTP 409 while a completions request runs (as vLLM routers refuse it).

The model is a `Script` per prompt (`tests/helpers/scripted_turns.py`): the text it writes, continued from
where the sequence stands. A log-prob can be made NaN (`nan_logprob_at`), which vLLM's pydantic replies serialise as
`null`.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from helpers.testing_utils import reply_json


class VLLMLikeServer:
    def __init__(self, scripts: dict, tokenizer, max_model_len: int = 64, nan_logprob_at: int | None = None):
        outer = self
        self.scripts, self.tokenizer, self.max_model_len = scripts, tokenizer, max_model_len
        self.nan_logprob_at = nan_logprob_at
        self.bodies, self.refused, self.lock, self.running = [], [], threading.Lock(), 0
        self.finish_reason = None  # forces every choice's finish_reason (e.g. "abort")
        self.abort_prompts = []  # the choices of sequences starting with one of these prompts are aborted
        self.delay_s, self.peak = 0.0, 0  # time each completions request takes; most requests generating at once

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path.startswith("/v1/models"):
                    reply_json(self, 200, {"data": [{"id": "policy", "max_model_len": outer.max_model_len}]})
                else:  # /health
                    reply_json(self, 200, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path.startswith("/reset_prefix_cache"):
                    with outer.lock:
                        busy = outer.running
                    if busy:
                        reply_json(self, 409, {"error": {"message": f"{busy} requests are running"}})
                    else:
                        reply_json(self, 200, {})
                    return
                outer.complete(self, body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def ids(self, text):
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def complete(self, handler, body):
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        max_tokens = body["max_tokens"]
        with self.lock:
            self.bodies.append(body)
        for prompt in prompts:  # vLLM: max_input_tokens = max_model_len - max_tokens, checked for every prompt
            if len(prompt) > self.max_model_len - max_tokens:
                message = (
                    f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                    f"contains {len(prompt)} input tokens and you requested {max_tokens} output tokens."
                )
                with self.lock:
                    self.refused.append(body)
                reply_json(handler, 400, {"error": {"message": message, "type": "BadRequestError", "code": 400}})
                return
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        try:
            time.sleep(self.delay_s)
            outputs = [self.turn(p, body) for p in prompts]
        finally:
            with self.lock:
                self.running -= 1
        choices = []
        for i, (prompt, (ids, reason)) in enumerate(zip(prompts, outputs, strict=True)):
            lps = [None if k == self.nan_logprob_at else -t / 100 for k, t in enumerate(ids)]
            # TRL's client reads NaN (JSON `NaN`, not streamed); the streamed reply writes `null`.
            lps = [float("nan") if lp is None and not body.get("stream") else lp for lp in lps]
            logprobs = {
                "tokens": [f"token_id:{t}" for t in ids],
                "token_logprobs": lps,
                "top_logprobs": [{f"token_id:{t}": lp} for t, lp in zip(ids, lps, strict=True)],
            }
            choices.append(
                {
                    "index": i,
                    "prompt_token_ids": prompt,
                    "token_ids": ids,
                    "logprobs": logprobs,
                    "finish_reason": self.finish_reason or self.reason(prompt, reason),
                }
            )
        if not body.get("stream"):
            reply_json(handler, 200, {"choices": choices})
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "text/event-stream; charset=utf-8")
        handler.end_headers()
        for choice in choices:
            handler.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        handler.wfile.write(b"data: [DONE]\n\n")

    def reason(self, prompt, reason):
        aborted = any(list(prompt[: len(p)]) == list(p) for p in self.abort_prompts)
        return "abort" if aborted else reason

    def turn(self, sequence, body):
        """The script's next tokens for `sequence`, and the finish reason, as vLLM stops."""
        script = next(s for k, s in self.scripts.items() if tuple(sequence[: len(k)]) == k)
        written = self.tokenizer.decode(sequence[len(script.prompt) :])
        while "<interpreter>" in written:  # what the model wrote: the sequence without the interpreter blocks
            head, _, rest = written.partition("<interpreter>")
            written = head + rest.partition("</interpreter>")[2]
        stops = body.get("stop") or []
        stop_ids = set(body.get("stop_token_ids") or [])
        room = min(body["max_tokens"], self.max_model_len - len(sequence))
        cursor, out = len(self.ids(written)), []
        while len(out) < room:
            if cursor >= len(script.ids):
                out.append(self.tokenizer.eos_token_id)
                return out, "stop"
            out.append(script.ids[cursor])
            cursor += 1
            if out[-1] in stop_ids or any(stop in self.tokenizer.decode(out) for stop in stops):
                return out, "stop"
        return out, "length"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
