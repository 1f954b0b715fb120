"""The two rollout loops against a vLLM-like server: the barrier one through TRL's own server-mode generation and
client, the async one through the completions engine."""

from __future__ import annotations

import types

import httpx
import torch

from helpers.scripted_turns import TOKENIZER
from helpers.testing_utils import trl_server_generation
from retool_trl.rollout.batched import interleaved_rollout
from retool_trl.rollout.engines.vllm_batched import VLLMBackend
from retool_trl.rollout.per_completion import CompletionsEngine, async_rollout
from retool_trl.testing import FakeSandbox


def trl_server_helper(url, monkeypatch, generation_kwargs=None):
    """TRL's own server-mode `VLLMGeneration.generate` with TRL's real `VLLMClient`, one training process."""
    from trl.generation import vllm_generation as trl_vllm
    from trl.generation.vllm_client import VLLMClient

    monkeypatch.setattr(trl_vllm, "gather_object", lambda xs: list(xs))
    monkeypatch.setattr(trl_vllm, "broadcast_object_list", lambda xs, from_process=0: xs)
    accelerator = types.SimpleNamespace(
        num_processes=1, process_index=0, is_main_process=True, device=torch.device("cpu")
    )
    # TRL's client, its `generate`, `_post` and log-prob parsing as they are; its HTTP session an httpx one (the same
    # `get`/`post` interface), since this environment has no `requests`.
    client = object.__new__(VLLMClient)
    client.__dict__.update(base_url=url, session=httpx.Client(timeout=30), communicator=None, _updating_weights=False)
    client.model = client._get(f"{url}/v1/models")["data"][0]["id"]
    helper = trl_server_generation(accelerator, client, generation_kwargs)
    return helper, accelerator


def max_model_len_of(url) -> int | None:
    """The context limit the trainer reads from the server (`ReToolTrainer._engine_max_model_len`)."""
    from retool_trl.trainer import ReToolTrainer

    view = types.SimpleNamespace(
        use_vllm=True,
        vllm_generation=types.SimpleNamespace(mode="server"),
        args=types.SimpleNamespace(vllm_server_base_url=url),
    )
    return ReToolTrainer._engine_max_model_len(view)


def run_loop(loop, server, prompts, spec, monkeypatch, generation_kwargs=None):
    if loop == "barrier":
        helper, accelerator = trl_server_helper(server.url, monkeypatch, generation_kwargs)
        backend = VLLMBackend(helper, TOKENIZER, "</code>", accelerator=accelerator, max_model_len=spec.max_model_len)
        return interleaved_rollout(prompts, backend, FakeSandbox(), TOKENIZER, spec)
    sampling = {"temperature": 1.0, **(generation_kwargs or {})}
    engine = CompletionsEngine(server.url, TOKENIZER, "</code>", sampling=sampling)  # model and limit from the server
    return async_rollout(prompts, engine, FakeSandbox(), TOKENIZER, spec)
