"""One training process of the multi-process engine tests (run by `torchrun`, gloo backend, CPU, with every
collective checked as NCCL checks it: `nccl_harness`).

    torchrun --nproc_per_node 2 tests/helpers/multiproc_worker.py MODE OUT_DIR [SERVER_URL]

MODE: `ddp` (transformers backend, a tiny Qwen2 forced to scripted completions), `vllm_server` (greedy quickstart
model through a real vLLM server), `vllm_server_sync` (a training step's weights pushed to that server by TRL's own
`sync_weights`, then the async rollout) or `vllm_colocate` (greedy quickstart model, one colocated engine per
rank). FSDP is not run: accelerate enables it only for multi-device distributed types, never for several CPU
processes. Prompts are split so that the ranks need different numbers of turns (rank 0's completions call code, rank
1's never). Each rank writes `OUT_DIR/rank{R}.json`: prompt -> the completion's text and interpreter mask, and the
training losses.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
# Run by path (torchrun): `tests/` on sys.path, so that `helpers` imports as the tests import it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import LogitsProcessorList  # noqa: E402

from helpers.nccl_harness import nccl_faithful  # noqa: E402
from helpers.testing_utils import make_char_tokenizer  # noqa: E402
from retool_trl import ReToolConfig, ReToolTrainer  # noqa: E402
from retool_trl.models.tiny import ScriptForcingProcessor, save_tiny_model, script_turns  # noqa: E402
from retool_trl.rollout.engines.transformers_generate import TransformersBackend  # noqa: E402
from retool_trl.sandbox import LocalSandbox  # noqa: E402

CODE_SCRIPT = "Compute.<code>x = {a} * 3\nprint(x)</code>Add.<code>print(x + 1)</code>So \\boxed{{{b}}}."
PLAIN_SCRIPT = "No code: \\boxed{{{a}}}."


def scripted_workload(num_prompts: int = 4):
    """Prompts of equal length; the first half call code twice, the second half answer directly."""
    prompts, scripts = [], []
    for i in range(num_prompts):
        a = 10 + i
        prompts.append(f"Q{i:02d}?")
        scripts.append(CODE_SCRIPT.format(a=a, b=3 * a + 1) if i < num_prompts // 2 else PLAIN_SCRIPT.format(a=a))
    return prompts, scripts


class ScriptedTrainer(ReToolTrainer):
    """ReToolTrainer whose transformers backend is forced to `turns` (every forward pass still runs)."""

    forced_turns: dict = None  # set before construction

    def _make_generation_backend(self, unwrapped_model):
        turns, tokenizer = self.forced_turns, self._tokenizer
        return TransformersBackend(
            unwrapped_model,
            tokenizer,
            self.generation_config,
            self.args.code_end,
            self.eos_token_ids,
            logits_processor=lambda: LogitsProcessorList([ScriptForcingProcessor(turns, tokenizer)]),
        )


def record(trainer, seen: dict) -> None:
    """Keeps each completion's text and interpreter mask per prompt (from TRL's `_generate`)."""
    original = trainer._generate

    def generate(prompts):
        out = original(prompts)
        completion_ids, tool_mask = out[1], out[2]
        for prompt, ids, mask in zip(prompts, completion_ids, tool_mask, strict=True):
            seen.setdefault(prompt, []).append([trainer._tokenizer.decode(ids), list(mask)])
        return out

    trainer._generate = generate


def _note(result, engine_calls: list):
    engine_calls.append(result.engine_calls[0] if result.engine_calls else 0)
    return result


def train_scripted(out_dir: Path, rank: int, world: int) -> dict:
    tokenizer = make_char_tokenizer()
    prompts, scripts = scripted_workload(2)
    model_dir = out_dir / "model"
    if rank == 0:
        save_tiny_model(model_dir, tokenizer, hidden_size=32, num_layers=2, seed=0)
    if world > 1:
        dist.barrier()
    ScriptedTrainer.forced_turns = {
        tuple(tokenizer(p, add_special_tokens=False)["input_ids"]): script_turns(tokenizer, s)
        for p, s in zip(prompts, scripts)
    }
    args = ReToolConfig(
        output_dir=str(out_dir / "run"),
        max_steps=1,
        per_device_train_batch_size=4 // world,
        num_generations=2,
        max_completion_length=96,
        report_to="none",
        bf16=False,
        use_cpu=True,
        beta=0.0,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        shuffle_dataset=False,
    )
    # With two processes rank r gets prompt r (TRL's sampler deals the groups out in order without shuffling):
    # rank 0's completions need three turns, rank 1's one. One process gets both.
    dataset = Dataset.from_list([{"prompt": p} for p in prompts])
    with LocalSandbox(num_workers=1, timeout_s=10.0) as sandbox:
        trainer = ScriptedTrainer(
            str(model_dir),
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            sandbox=sandbox,
        )
        seen: dict = {}
        record(trainer, seen)
        engine_calls = []
        original_rollout = trainer._generate_rollout
        trainer._generate_rollout = lambda ids: _note(original_rollout(ids), engine_calls)
        # gloo accepts host tensors; the GPU runs this stands for use NCCL, which does not.
        with nccl_faithful():
            trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"completions": seen, "losses": losses, "engine_calls": engine_calls}


def rollout_server(out_dir: Path, rank: int, world: int, server_url: str) -> dict:
    from trl.generation.vllm_client import VLLMClient

    from helpers.engine_helpers import engine_config, quickstart_tokenizer
    from retool_trl.quickstart import model_path

    # NCCL (weight sync with the server) needs CUDA; the rollout's cross-process calls are what is tested here.
    VLLMClient.init_communicator = lambda self, device=None: None
    prompts_by_rank = json.loads((out_dir / "prompts.json").read_text())
    tokenizer = quickstart_tokenizer()
    args = engine_config(
        out_dir / "run",
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server_url,
        per_device_train_batch_size=2,
        num_generations=2,
    )
    with LocalSandbox(num_workers=1, timeout_s=10.0) as sandbox:
        dataset = Dataset.from_list([{"prompt": "x", "answer": "1"}] * 8)
        trainer = ReToolTrainer(
            model_path(), args=args, train_dataset=dataset, processing_class=tokenizer, sandbox=sandbox
        )
        trainer.vllm_generation.temperature = 0.0  # greedy: comparable with the single-process rollout
        trainer._last_loaded_step = trainer.state.global_step  # no weight sync (needs NCCL)
        trainer.model.train()
        # Both loops: the barrier one (collective calls through TRL's helper) and the async one (each rank its own
        # requests), on ranks that need different numbers of turns.
        completions = {}
        for mode in ("barrier", "async"):
            trainer.args.rollout_mode = mode
            completions[mode] = seen = {}
            generate = trainer._generate
            record(trainer, seen)
            with nccl_faithful():
                trainer._generate(prompts_by_rank[rank])
            trainer._generate = generate
    return {"completions": completions, "losses": []}


def policy_logprobs(model, prompt_ids, completion_ids, n: int) -> list[list[float]]:
    """Log-probs of the first `n` tokens of each completion under `model` (eval mode, no grad)."""
    model.eval()
    rows = []
    with torch.no_grad():
        for prompt, completion in zip(prompt_ids, completion_ids, strict=True):
            ids = torch.tensor([list(prompt) + list(completion)])
            logits = model(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + n].float()
            targets = torch.tensor(list(completion[:n]))
            rows.append(torch.log_softmax(logits, -1)[torch.arange(len(targets)), targets].tolist())
    model.train()
    return rows


def rollout_server_sync(out_dir: Path, rank: int, world: int, server_url: str) -> dict:
    """A new training step in server mode: the policy's weights changed (the same on every rank), TRL's `_generate`
    syncs them to the server (rank 0 pushes, then resets the prefix cache), then each rank's async rollout. Returns
    each rank's sampling log-probs of its completions' first tokens, and those tokens' log-probs under the updated
    and the previous policy."""
    from trl.generation.vllm_client import VLLMClient

    from helpers.engine_helpers import engine_config, push_by_reload, quickstart_tokenizer
    from retool_trl.quickstart import model_path

    VLLMClient.init_communicator = lambda self, device=None: None  # NCCL needs CUDA: the push goes by reload
    VLLMClient.update_named_params = push_by_reload(out_dir, model_path())
    prompts_by_rank = json.loads((out_dir / "prompts.json").read_text())
    args = engine_config(
        out_dir / "run",
        use_vllm=True,
        vllm_mode="server",
        vllm_server_base_url=server_url,
        per_device_train_batch_size=2,
        num_generations=2,
        rollout_mode="async",
    )
    with LocalSandbox(num_workers=1, timeout_s=10.0) as sandbox:
        dataset = Dataset.from_list([{"prompt": "x", "answer": "1"}] * 8)
        trainer = ReToolTrainer(
            model_path(), args=args, train_dataset=dataset, processing_class=quickstart_tokenizer(), sandbox=sandbox
        )
        trainer.vllm_generation.temperature = 0.0
        trainer.model.train()
        # The step's update, the same on every rank: the last layer's MLP output flips sign (not the tied embedding,
        # whose LM head vLLM's CPU build keeps packed from the old one on a reload).
        weight = trainer.model.model.layers[-1].mlp.down_proj.weight
        with torch.no_grad():
            weight.mul_(-1.0)
        trainer.state.global_step = trainer._last_loaded_step + 1  # a new step: `_generate` syncs the weights first
        with nccl_faithful():
            out = trainer._generate(prompts_by_rank[rank])
        prompt_ids, completion_ids, logprobs = out[0], out[1], out[4]
        n = 8
        new = policy_logprobs(trainer.model, prompt_ids, completion_ids, n)
        with torch.no_grad():
            weight.mul_(-1.0)
        old = policy_logprobs(trainer.model, prompt_ids, completion_ids, n)
    return {"sampled": [list(lp[:n]) for lp in logprobs], "new": new, "old": old, "losses": []}


def rollout_colocate(out_dir: Path, rank: int, world: int) -> dict:
    """Each rank its own colocated engine; both loops, on ranks that need different numbers of turns (the async loop
    makes no collective call, so a rank that is done returns while the other still generates)."""
    from helpers.engine_helpers import engine_config, quickstart_tokenizer
    from retool_trl.quickstart import model_path

    prompts_by_rank = json.loads((out_dir / "prompts.json").read_text())
    tokenizer = quickstart_tokenizer()
    args = engine_config(
        out_dir / "run", use_vllm=True, vllm_mode="colocate", per_device_train_batch_size=2, num_generations=2
    )
    with LocalSandbox(num_workers=1, timeout_s=10.0) as sandbox:
        dataset = Dataset.from_list([{"prompt": "x", "answer": "1"}] * 8)
        trainer = ReToolTrainer(
            model_path(), args=args, train_dataset=dataset, processing_class=tokenizer, sandbox=sandbox
        )
        trainer.vllm_generation.temperature = 0.0  # greedy: both loops give the same completions
        trainer._last_loaded_step = trainer.state.global_step
        trainer.model.train()
        completions, turns = {}, {}
        for mode in ("barrier", "async"):
            trainer.args.rollout_mode = mode
            completions[mode] = seen = {}
            generate, rollout = trainer._generate, trainer._generate_rollout
            record(trainer, seen)
            notes = []
            trainer._generate_rollout = lambda ids, rollout=rollout, notes=notes: (
                notes.append(rollout(ids)) or notes[-1]
            )
            trainer._generate(prompts_by_rank[rank])
            turns[mode] = notes[-1].num_turns
            trainer._generate, trainer._generate_rollout = generate, rollout
    return {"completions": completions, "turns": turns, "losses": []}


def main() -> None:
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    if mode == "ddp":
        result = train_scripted(out_dir, rank, world)
    elif mode == "vllm_server":
        result = rollout_server(out_dir, rank, world, sys.argv[3])
    elif mode == "vllm_server_sync":
        result = rollout_server_sync(out_dir, rank, world, sys.argv[3])
    elif mode == "vllm_colocate":
        result = rollout_colocate(out_dir, rank, world)
    else:
        raise SystemExit(f"unknown mode {mode!r}: use ddp, vllm_server, vllm_server_sync or vllm_colocate")
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
