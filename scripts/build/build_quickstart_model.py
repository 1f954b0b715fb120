"""Builds the quickstart checkpoint shipped in `retool_trl/assets/quickstart_model/`.

Character-level tokenizer + tiny randomly initialised Qwen2, cold-started with `retool_trl.sft` on synthetic
arithmetic traces (70% call the interpreter, 30% answer directly; prompt and interpreter tokens masked from the
loss). Takes a few minutes on 2 CPU cores:

    python scripts/build/build_quickstart_model.py [--output-dir DIR] [--max-steps N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict

import torch

from retool_trl.data.synthetic import make_sft_traces
from retool_trl.models.tiny import build_char_tokenizer, build_tiny_model
from retool_trl.quickstart import QUICKSTART_MODEL_DIR, QuickstartTask
from retool_trl.sft import build_sft_dataset, masked_token_stats, train_cold_start


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default=str(QUICKSTART_MODEL_DIR), help="Where the checkpoint is saved.")
    parser.add_argument("--num-traces", type=int, default=32000, help="Synthetic SFT traces.")
    parser.add_argument("--max-steps", type=int, default=2000, help="SFT optimizer steps.")
    parser.add_argument("--batch-size", type=int, default=16, help="Traces per step.")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="Peak learning rate (cosine decay).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of data, initialisation and training.")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice).")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    task = QuickstartTask()
    started = time.perf_counter()

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=args.seed)
    print(f"tokenizer: {len(tokenizer)} tokens; model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params")

    traces = make_sft_traces(
        args.num_traces,
        seed=args.seed,
        difficulty=task.sft_difficulties,
        kinds=task.kinds,
        code_fraction=task.code_fraction,
        test_fraction=task.test_fraction,
    )
    dataset = build_sft_dataset(traces, tokenizer)
    stats = masked_token_stats(dataset)
    print(
        f"traces: {len(dataset)} ({sum(traces['uses_code']) / len(traces):.0%} with code), "
        f"{stats['tokens']:.0f} tokens, {stats['trained_fraction']:.0%} trained"
    )

    model, final_loss = train_cold_start(
        model, tokenizer, dataset, args.max_steps, args.batch_size, args.learning_rate, seed=args.seed
    )
    shutil.rmtree(args.output_dir, ignore_errors=True)
    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    build_info = {
        "task": asdict(task),
        "num_traces": args.num_traces,
        "max_steps": args.max_steps,
        "batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
        "seed": args.seed,
        "final_loss": final_loss,
        "build_s": round(time.perf_counter() - started, 1),
    }
    with open(f"{args.output_dir}/build_info.json", "w") as f:
        json.dump(build_info, f, indent=2)
    print(f"saved to {args.output_dir} in {build_info['build_s']} s (final loss {final_loss:.4f})")


if __name__ == "__main__":
    main()
