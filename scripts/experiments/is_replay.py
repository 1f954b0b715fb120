"""The vLLM importance-sampling ratio at step 0 under truncated sampling, with and without sampling-mask replay.

At step 0 the trainer and vLLM hold the same weights, so every token's ratio should be 1 up to the engine's rounding.
With `top_k` / `top_p`, vLLM's log-probs are renormalised over the kept tokens and the plain ratio is the kept mass
instead; the replay renormalises the trainer's side over the same tokens (`retool_trl.training.sampling_mask`).
One colocated vLLM engine (vLLM's CPU build), the shipped quickstart model, one scored batch per setting and arm;
prints a table and, with `--json`, one JSON object as the last line, and appends it to
`scripts/results/is_replay.jsonl`. `--engine server` measures through a vLLM server instead. Run with
`.venv-engines/bin/python` (see `scripts/test_engines.sh`):

    .venv-engines/bin/python scripts/experiments/is_replay.py --json
    .venv-engines/bin/python scripts/experiments/is_replay.py --engine server --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # scripts/ is not a package

# (name, top_k, top_p): the settings users pick most, one per kind of truncation and one combined.
SETTINGS = (("top_k=8", 8, 1.0), ("top_p=0.8", 0, 0.8), ("top_k=20,top_p=0.95", 20, 0.95))
# vLLM's highest temperature: the quickstart model is sharply peaked, and at 1.0 the truncations cut about 1% of the
# mass, within any tolerance; at 2.0 the bias the replay removes shows (a larger model is less peaked at 1.0).
TEMPERATURE = 2.0


def build_trainer(output_dir, sandbox, num_prompts: int = 8, num_generations: int = 4, server_url: str | None = None):
    """A `ReToolTrainer` on the quickstart model with a colocated vLLM engine (or the vLLM server at `server_url`,
    serving the same checkpoint), built for replay (`top_k=8`; the settings are switched per measurement, on the
    same engine: vLLM runs one colocated engine per process)."""
    from retool_trl import ReToolConfig, ReToolTrainer
    from retool_trl.data.synthetic import make_arithmetic_dataset
    from retool_trl.models.tokenizers import load_tokenizer
    from retool_trl.quickstart import model_path

    args = ReToolConfig(
        output_dir=str(output_dir),
        max_steps=1,
        logging_steps=1,
        per_device_train_batch_size=num_prompts * num_generations,
        num_generations=num_generations,
        max_completion_length=64,
        max_tool_calls=2,
        max_interpreter_output_chars=64,
        system_prompt="none",
        sandbox_workers=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
        use_vllm=True,
        vllm_mode="server" if server_url else "colocate",
        vllm_server_base_url=server_url,
        vllm_max_model_length=512,
        beta=0.0,
        temperature=TEMPERATURE,
        top_k=8,
        # The per-token ratio, unclipped: what is measured is the ratio, not TRL's treatment of outliers.
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=1e9,
    )
    dataset = make_arithmetic_dataset(num_prompts, seed=0)
    model = model_path()
    trainer = ReToolTrainer(
        model, args=args, train_dataset=dataset, processing_class=load_tokenizer(model), sandbox=sandbox
    )
    rows = [dataset[i] for i in range(num_prompts) for _ in range(num_generations)]
    return trainer, rows


def measure(trainer, rows, top_k: int, top_p: float, replay: bool, rollout_mode: str = "async") -> dict:
    """One scored batch at the trainer's current weights with these settings: the mean completion-token IS ratio
    and the share outside [0.9, 1.1] (`retool/is/*`), and TRL's own mean. `rollout_mode="barrier"`: through TRL's
    batched `generate` (the kept sets from the top log-probs it returns)."""
    from retool_trl.training.sampling_mask import replay_for

    helper = trainer.vllm_generation
    helper.top_k, helper.top_p = top_k, top_p
    trainer.args.top_k, trainer.args.top_p = top_k, top_p
    trainer.args.rollout_mode = rollout_mode
    # None: today's uncorrected ratio.
    trainer._replay = replay_for(trainer.args, helper, len(trainer.processing_class)) if replay else None
    if helper.mode == "server":  # the server holds the checkpoint's weights; syncing needs NCCL, which CPUs lack
        trainer._last_loaded_step = trainer.state.global_step
    trainer.model.train()
    trainer._generate_and_score_completions(rows)
    metrics = trainer._metrics["train"]
    return {
        "ratio_mean": metrics["retool/is/ratio_mean"][-1],
        "outside_0.9_1.1": metrics["retool/is/outside_0.9_1.1"][-1],
        "trl_ratio_mean": metrics["sampling/importance_sampling_ratio/mean"][-1],
        "kept_set_source": trainer._replay.source if trainer._replay else None,
    }


@contextlib.contextmanager
def served(start: bool):
    """A vLLM server on 127.0.0.1 serving the quickstart model (its URL), stopped on exit; `None` when not `start`.
    TRL's server-mode weight sync opens an NCCL group at init, which CPUs lack: skipped (the server serves the
    checkpoint the trainer starts from, the same weights at step 0)."""
    if not start:
        yield None
        return
    import httpx
    from trl.generation.vllm_client import VLLMClient

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serve"))
    from vllm_serve import local_command

    from retool_trl.quickstart import model_path

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(
        local_command(model_path(), port, 512), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url, original = f"http://127.0.0.1:{port}", VLLMClient.init_communicator
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"the vLLM server did not start: {log.read()[-2000:].decode(errors='replace')}")
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        VLLMClient.init_communicator = lambda self, device=None: None
        yield url
    finally:
        VLLMClient.init_communicator = original
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
        log.close()


def main(argv=None) -> int:
    import results_log

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per batch (x4 completions)")
    parser.add_argument(
        "--engine",
        choices=("colocate", "server"),
        default="colocate",
        help="the colocated engine, or a vLLM server started here (`scripts/serve/vllm_serve.py`) on the same model",
    )
    results_log.add_arguments(parser)
    args = parser.parse_args(argv)
    run = results_log.conditions()

    from retool_trl.sandbox import LocalSandbox

    figures: dict = {
        "engine": args.engine,
        "temperature": TEMPERATURE,
        "completions": args.prompts * 4,
        "settings": {},
    }
    with (
        LocalSandbox(num_workers=1, timeout_s=10.0) as sandbox,
        tempfile.TemporaryDirectory() as out,
        served(args.engine == "server") as url,
    ):
        trainer, rows = build_trainer(out, sandbox, num_prompts=args.prompts, server_url=url)
        for name, top_k, top_p in SETTINGS:
            figures["settings"][name] = {
                "replay": measure(trainer, rows, top_k, top_p, replay=True),
                "no_replay": measure(trainer, rows, top_k, top_p, replay=False),
            }
    print(
        f"step-0 IS ratio ({args.engine}), temperature {TEMPERATURE}, {figures['completions']} completions per setting"
    )
    print(f"{'setting':<22}{'mean (replay)':>15}{'outside':>10}{'mean (none)':>14}{'outside':>10}")
    for name, arms in figures["settings"].items():
        on, off = arms["replay"], arms["no_replay"]
        print(
            f"{name:<22}{on['ratio_mean']:>15.4f}{on['outside_0.9_1.1']:>10.1%}"
            f"{off['ratio_mean']:>14.4f}{off['outside_0.9_1.1']:>10.1%}"
        )
    results_log.record("is_replay", figures, run, enabled=not args.no_record)
    if args.json:
        print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
