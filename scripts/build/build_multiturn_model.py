"""Builds the multi-turn quickstart checkpoint shipped in `retool_trl/assets/multiturn_model/`.

The first quickstart's checkpoint (same character-level tokenizer and tags; it already copies an expression into
code and an interpreter's output into `\\boxed{}`), cold-started further with `retool_trl.sft` on synthetic multi-turn
traces (`retool_trl.data.synthetic_multiturn.multiturn_trace`): half
solve `a*b+c*d+e*f` cleanly in two dependent cells, half start with a failing cell (NameError, SyntaxError, a cell
over the length budget), and of those 60% read the error and correct it while 40% give up. Prompt and interpreter
tokens are masked from the loss. The weights are stored in float16 (the config keeps `dtype: float32`, so they load
as float32) to keep the checkpoint under 2 MB. About 10 minutes on 2 CPU cores:

    python scripts/build/build_multiturn_model.py [--output-dir DIR] [--max-steps N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from retool_trl.data.synthetic_multiturn import make_multiturn_sft_traces
from retool_trl.quickstart import QUICKSTART_MODEL_DIR, build_char_tokenizer, build_tiny_model
from retool_trl.quickstart.multiturn import MULTITURN_MODEL_DIR, MultiturnTask
from retool_trl.sft import build_sft_dataset, masked_token_stats, train_cold_start


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default=str(MULTITURN_MODEL_DIR), help="Where the checkpoint is saved.")
    parser.add_argument(
        "--init-from",
        default=str(QUICKSTART_MODEL_DIR),
        help="Checkpoint to start from (default: the first quickstart's); 'none' for a fresh tiny model "
        "(a few times more steps needed before it copies interpreter output).",
    )
    parser.add_argument("--num-traces", type=int, default=19200, help="Synthetic SFT traces.")
    parser.add_argument("--max-steps", type=int, default=1200, help="SFT optimizer steps.")
    parser.add_argument("--batch-size", type=int, default=16, help="Traces per step.")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="Peak learning rate (cosine decay).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of data, initialisation and training.")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: fastest on a shared 2-core machine)."
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    task = MultiturnTask()
    started = time.perf_counter()

    tokenizer = build_char_tokenizer()
    if args.init_from.lower() == "none":
        model = build_tiny_model(tokenizer, seed=args.seed, **task.architecture)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        if model.config.vocab_size != len(tokenizer):
            raise SystemExit(
                f"--init-from {args.init_from}: vocabulary of {model.config.vocab_size} tokens, expected "
                f"the character tokenizer's {len(tokenizer)}."
            )
    print(f"tokenizer: {len(tokenizer)} tokens; model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params")

    traces = make_multiturn_sft_traces(
        args.num_traces,
        seed=args.seed,
        failure_fraction=task.failure_fraction,
        recover_fraction=task.recover_fraction,
        test_fraction=task.test_fraction,
        max_cell_chars=task.max_cell_chars,
    )
    dataset = build_sft_dataset(traces, tokenizer)
    stats = masked_token_stats(dataset)
    longest = max(len(ids) for ids in dataset["input_ids"])
    print(
        f"traces: {len(dataset)} ({sum(f != '' for f in traces['failure']) / len(traces):.0%} with a failing cell), "
        f"{stats['tokens']:.0f} tokens, {stats['trained_fraction']:.0%} trained, longest {longest} tokens"
    )

    model, final_loss = train_cold_start(
        model, tokenizer, dataset, args.max_steps, args.batch_size, args.learning_rate, seed=args.seed
    )
    shutil.rmtree(args.output_dir, ignore_errors=True)
    model.to(torch.float16).save_pretrained(args.output_dir)  # half the bytes; training precision is not needed
    config_file = Path(args.output_dir, "config.json")
    config = json.loads(config_file.read_text())
    config["dtype"] = "float32"  # load (and train) in float32 by default
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(args.output_dir)
    build_info = {
        "task": asdict(task),
        "init_from": Path(args.init_from).name if args.init_from.lower() != "none" else None,
        "model": {
            k: getattr(model.config, k)
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        },
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
