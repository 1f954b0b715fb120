"""The vLLM server's context limit in both rollout loops: each row gets the budget that fits its own context, and a
turn cut at the limit ends truncated."""

from __future__ import annotations

import types

import pytest

from helpers.scripted_turns import EOS, TOKENIZER, Script, ids_of
from helpers.server_loops import max_model_len_of, run_loop
from helpers.vllm_like_server import VLLMLikeServer
from retool_trl.rollout.batched import RolloutSpec, interleaved_rollout
from retool_trl.testing import FakeSandbox

# ------------------------------------------------------------------------ budgets that fit each row's context
LONG = "Q" * 30 + ":"  # 31 prompt tokens


@pytest.mark.parametrize("loop", ["barrier", "async"])
def test_rows_of_different_context_each_get_the_budget_that_fits(loop, monkeypatch):
    """A server started with a small `--max_model_len` (48, TRL's advice: close to prompt + completion), a batch with a
    short and a long prompt, `max_completion_length` 30. Each row alone fits (2 + 30, 31 + 17), together one request
    with max_tokens 30 does not (31 + 30 > 48) and vLLM refuses it whole (HTTP 400; before: the run stopped). Now
    every row gets the budget its context leaves; the long one fills the context and ends truncated (never a void
    turn followed by a prompt past the limit); a row that calls code continues within the context."""
    texts = ["<code>print(1)</code>so \\boxed{1}", "x" * 40 + " \\boxed{2}"]
    prompts = [ids_of("Q:"), ids_of(LONG)]
    scripts = {tuple(p): Script(p, t) for p, t in zip(prompts, texts, strict=True)}
    server = VLLMLikeServer(scripts, TOKENIZER, max_model_len=48)
    try:
        limit = max_model_len_of(server.url)
        assert limit == 48
        spec = RolloutSpec(max_completion_length=30, eos_token_ids=[EOS], max_tool_calls=2, max_model_len=limit)
        result = run_loop(loop, server, prompts, spec, monkeypatch)
    finally:
        server.close()
    assert not server.refused
    for body in server.bodies:  # every request fits every one of its prompts
        rows = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        assert all(len(p) + body["max_tokens"] <= 48 for p in rows)
    # The short row: its code ran and its answer is whole. The long row: cut at the context limit, truncated.
    assert result.num_tool_calls[0] == 1 and result.model_text[0].endswith("\\boxed{1}")
    assert result.completion_ids[0][-1] == EOS
    assert len(prompts[1]) + len(result.completion_ids[1]) == 48
    assert result.completion_ids[1][-1] != EOS and result.model_text[1] == "x" * 17
    assert result.num_void_turns == [0, 0] and result.num_turns[1] == 1 and not any(result.infra_failed)


def test_a_turn_cut_at_the_context_limit_after_code_ends_truncated():
    """prompt + max_completion_length > max_model_len: the context fills after an interpreter block. The completion
    ends truncated there (before: the turn was counted void and the next prompt passed the limit)."""
    from retool_trl.testing import ScriptedBackend

    prompt = ids_of("Q:")
    text = "<code>print(12345)</code>" + "y" * 50
    spec = RolloutSpec(max_completion_length=200, eos_token_ids=[EOS], max_tool_calls=2, max_model_len=60)
    asked = []

    class Recording(ScriptedBackend):
        def generate_turn(self, sequences, max_new_tokens, stop_at_code_end):
            asked.extend(len(s) + b for s, b in zip(sequences, max_new_tokens, strict=True))
            return super().generate_turn(sequences, max_new_tokens, stop_at_code_end)

    result = interleaved_rollout([prompt], Recording(TOKENIZER, [text]), FakeSandbox(), TOKENIZER, spec)
    assert max(asked) <= 60
    assert len(prompt) + len(result.completion_ids[0]) == 60
    assert result.num_tool_calls == [1] and result.num_void_turns == [0] and result.num_turns == [2]


# ------------------------------------------------------------------- the context limit asked of a failing server
def models_server(replies):
    """An HTTP server answering `GET /v1/models` with `replies` in turn (status, body), the last one for ever."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from helpers.testing_utils import reply_json

    asked = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            status, body = replies[min(len(asked), len(replies) - 1)]
            asked.append(self.path)
            reply_json(self, status, body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}", asked


def test_a_failed_answer_about_the_context_limit_is_asked_again_not_kept_as_no_limit(monkeypatch):
    """A vLLM server that answers `/v1/models` with HTTP 503 once (starting up, behind a router that is restarting
    a replica). Before, the error was cached as "no limit" for the whole run: turns were no longer fitted to the
    context and the first full context stopped the run with HTTP 400. Now the question is asked again and the
    server's limit is used; a card that has no limit is the only answer kept as none."""
    from helpers.server_loops import max_model_len_of
    from retool_trl import trainer

    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(sleep=lambda s: None), raising=False)
    card = {"data": [{"id": "policy", "max_model_len": 4096}]}
    httpd, url, asked = models_server([(503, {"error": "starting"}), (200, card)])
    try:
        assert max_model_len_of(url) == 4096 and len(asked) == 2
    finally:
        httpd.shutdown()
    httpd, url, asked = models_server([(200, {"data": [{"id": "policy"}]})])
    try:
        assert max_model_len_of(url) is None and len(asked) == 1
    finally:
        httpd.shutdown()


def test_a_server_down_for_longer_is_asked_again_at_the_next_rollout(monkeypatch):
    """The server keeps failing for the first rollout: no limit for that one (with a warning), and the next rollout
    asks again and gets it (before: never asked again)."""
    from retool_trl import trainer
    from retool_trl.trainer import ReToolTrainer

    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(sleep=lambda s: None), raising=False)
    card = {"data": [{"id": "policy", "max_model_len": 2048}]}
    httpd, url, asked = models_server([(500, {})] * 3 + [(200, card)])
    view = types.SimpleNamespace(
        use_vllm=True,
        vllm_generation=types.SimpleNamespace(mode="server"),
        args=types.SimpleNamespace(vllm_server_base_url=url),
    )
    try:
        assert ReToolTrainer._engine_max_model_len(view) is None
        assert ReToolTrainer._engine_max_model_len(view) == 2048
        assert ReToolTrainer._engine_max_model_len(view) == 2048 and len(asked) == 4  # known: not asked again
    finally:
        httpd.shutdown()
