"""Dynamic sampling's scripted model, and one training process of its multi-process test (run by `torchrun`, gloo,
CPU, with every collective checked as NCCL checks it: `nccl_harness`).

    torchrun --nproc_per_node 2 tests/helpers/dynamic_sampling_worker.py OUT_DIR

Rank 0 starts from an all-right group (dropped), rank 1 from a group worth learning from: both must run the same
rounds, log the same metrics, and end with a full batch of kept rows and the same loss normaliser. Then a short
`train()` with `steps_per_generation=2`. Each rank writes `OUT_DIR/rank{R}.json`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
# Run by path: `helpers` imports as the tests import it, and `retool_trl` is this checkout's (not an installed one).
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

from retool_trl.testing import ScriptedBackend  # noqa: E402

RIGHT, WRONG = "\\boxed{42}", "\\boxed{0}"
METRICS = ("groups_dropped", "rounds", "zero_std_ratio", "capped")


def script_for(prompt: str, position: int) -> str:
    """What the scripted model writes for the `position`-th sequence of a rollout (groups are 4 in a row):
    `easy` prompts are all right (a zero-variance group), `hard` half right, `most` three quarters right, `void` half
    right and half a void turn (neither code nor an answer)."""
    if "void" in prompt:
        return RIGHT if position % 2 == 0 else "no idea"
    if "easy" in prompt:
        return RIGHT
    if "most" in prompt:
        return WRONG if position % 4 == 3 else RIGHT
    return RIGHT if position % 2 == 0 else WRONG


class ByPrompt:
    """A `ScriptedBackend` whose scripts are chosen from the prompts of its first call (each rollout builds one)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.inner = tokenizer, None

    def generate_turn(self, sequences, max_new_tokens, stop_at_code_end):
        if self.inner is None:
            prompts = [self.tokenizer.decode(seq) for seq in sequences]
            self.inner = ScriptedBackend(self.tokenizer, [script_for(p, i) for i, p in enumerate(prompts)])
        return self.inner.generate_turn(sequences, max_new_tokens, stop_at_code_end)


class AsyncByPrompt:
    """The async rollout's engine writing `script_for`'s answers, one request per completion: the n-th request with a
    given prompt is its group's n-th sequence."""

    def __init__(self, tokenizer):
        self.tokenizer, self.seen = tokenizer, {}

    async def generate(self, token_ids, max_tokens, stop_at_code_end):
        from retool_trl.rollout.types import TurnOutput

        prompt = self.tokenizer.decode(token_ids)
        position = self.seen[prompt] = self.seen.get(prompt, -1) + 1
        ids = self.tokenizer(script_for(prompt, position), add_special_tokens=False)["input_ids"]
        ids = [*ids, self.tokenizer.eos_token_id][:max_tokens]
        return TurnOutput(ids, [-0.5] * len(ids))


def use_async_loop(trainer) -> None:
    """Rolls out with the async loop (`rollout_mode: async`, which the trainer picks with vLLM) against
    `AsyncByPrompt`, in place of the barrier loop transformers generation uses."""
    from retool_trl.rollout.batched import RolloutSpec
    from retool_trl.rollout.per_completion import async_rollout

    def rollout(prompt_ids):
        spec = RolloutSpec.from_config(trainer.args, trainer.eos_token_ids, None, call_format=trainer._call_format)
        engine = AsyncByPrompt(trainer._tokenizer)
        return async_rollout(prompt_ids, engine, trainer.sandbox, trainer._tokenizer, spec, 8)

    trainer._generate_rollout = rollout


def rows(*kinds: str) -> list[dict]:
    """Dataset rows, one per kind (`"easy 1"`, `"hard"`, ...), each a distinct dict as a dataloader gives."""
    return [{"prompt": f"{kind}:", "answer": "42"} for kind in kinds]


def group(kind: str) -> list[dict]:
    return rows(*[kind] * 4)


def launch(out_dir: Path, nproc: int, timeout_s: float = 300) -> list[dict]:
    """Runs this file under torchrun on `nproc` CPU processes; returns each rank's record."""
    from helpers.engine_helpers import REPO, free_port

    out_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        str(Path(__file__).resolve()),
        str(out_dir),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def run_rank(out_dir: Path, rank: int, world: int) -> dict:
    import torch.distributed as dist
    from datasets import Dataset

    from helpers.nccl_harness import nccl_faithful
    from helpers.testing_utils import make_char_tokenizer
    from retool_trl import ReToolConfig, ReToolTrainer
    from retool_trl.models.tiny import save_tiny_model
    from retool_trl.testing import FakeSandbox

    tokenizer = make_char_tokenizer()
    model_dir = out_dir / "model"
    if rank == 0:
        save_tiny_model(model_dir, tokenizer)
    if world > 1:
        dist.barrier()
    args = ReToolConfig(
        output_dir=str(out_dir / "run"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=32,
        report_to="none",
        bf16=False,
        use_cpu=True,
        beta=0.0,
        seed=0,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        max_steps=2,
        steps_per_generation=2,
        dynamic_sampling=True,
    )
    dataset = Dataset.from_list(rows("easy 1", "easy 2", "hard 1", "hard 2", "hard 3"))
    trainer = ReToolTrainer(
        str(model_dir), args=args, train_dataset=dataset, processing_class=tokenizer, sandbox=FakeSandbox()
    )
    trainer._make_generation_backend = lambda model: ByPrompt(tokenizer)
    trainer.model.train()
    # One generation batch of 2 x 4 rows per process; rank 0's group has nothing to teach, rank 1's has.
    start = group("easy 0") * 2 if rank == 0 else group("hard 0") * 2
    with nccl_faithful():
        output = trainer._generate_and_score_completions(start)
    prompts = [tokenizer.decode(ids[m.bool()]) for ids, m in zip(output["prompt_ids"], output["prompt_mask"])]
    metrics = {name: trainer._metrics["train"][f"retool/dynamic_sampling/{name}"] for name in METRICS}
    kept_tokens = (output["completion_mask"] * output["tool_mask"]).sum().item()
    record = {
        "prompts": prompts,
        "advantages": output["advantages"].tolist(),
        "metrics": metrics,
        "num_items_in_batch": output["num_items_in_batch"].item(),
        "kept_tokens": kept_tokens,
    }
    trainer._metrics["train"].clear()
    with nccl_faithful():
        trainer.train()
    record["logs"] = [entry for entry in trainer.state.log_history if "retool/dynamic_sampling/rounds" in entry]
    return record


def main() -> None:
    import torch
    import torch.distributed as dist

    out_dir = Path(sys.argv[1])
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(1)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    (out_dir / f"rank{rank}.json").write_text(json.dumps(run_rank(out_dir, rank, world)))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
