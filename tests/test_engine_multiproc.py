"""Several training processes (`torchrun`, gloo, CPU) whose ranks need different numbers of turns: no hang, no
crash, and the same completions as one process. Engine stage (each launch starts fresh Python processes)."""

import json
import subprocess
import sys

import pytest
from engine_helpers import REPO, free_port

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]


def launch(mode: str, out_dir, nproc: int, *extra: str, timeout_s: float = 600) -> list[dict]:
    """Runs `tests/multiproc_worker.py` under torchrun; a hang fails the test at `timeout_s`, never blocks CI."""
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        str(REPO / "tests" / "multiproc_worker.py"),
        mode,
        str(out_dir),
        *extra,
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def merged_completions(results: list[dict]) -> dict:
    merged = {}
    for result in results:
        for prompt, completions in result["completions"].items():
            merged.setdefault(prompt, []).extend(completions)
    return merged


def test_ddp_ranks_with_different_turns_match_one_process(tmp_path):
    two = launch("ddp", tmp_path / "two", 2)
    one = launch("ddp", tmp_path / "one", 1)
    # Rank 0's completions call code twice (three turns), rank 1's answer at once (one turn).
    assert two[0]["engine_calls"] == [3] and two[1]["engine_calls"] == [1]
    assert merged_completions(two) == merged_completions(one)
    texts = [text for completions in merged_completions(one).values() for text, _ in completions]
    assert sum("<interpreter>31\n</interpreter>" in t for t in texts) == 2  # the code really ran, state kept


def test_colocate_async_two_processes_with_different_turns(tmp_path):
    """Two training processes, each with its own colocated engine, in the async loop (the default): rank 0's
    completions call code (two turns), rank 1's answer at once (one turn). Both finish, with the barrier loop's
    completions."""
    from engine_helpers import quickstart_dataset

    texts = list(quickstart_dataset(4, seed=1)["prompt"])
    solved = [f"{t}<code>print({t[8:-2]})</code><interpreter>{eval(t[8:-2])}\n</interpreter>" for t in texts[2:]]
    (tmp_path / "prompts.json").write_text(json.dumps([texts[:2], solved]))
    ranks = launch("vllm_colocate", tmp_path, 2)
    assert ranks[0]["turns"]["async"] == [2, 2] and ranks[1]["turns"]["async"] == [1, 1], ranks
    for rank in ranks:
        assert rank["completions"]["async"] == rank["completions"]["barrier"]
