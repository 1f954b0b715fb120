"""Builds the emergence quickstart checkpoint shipped in `retool_trl/assets/emerge_model/`.

The arithmetic quickstart's checkpoint (same character-level tokenizer and tags; from its own cold start it copies
an expression into `<code>print(...)</code>` and the interpreter's output into `\\boxed{}`), cold-started further
with `retool_trl.sft` on synthetic arithmetic traces of which only `code_fraction` (2.5% by default) call the
interpreter; the rest answer directly. This second cold start turns the habit down (from about 70% of answers to
about 2%) and leaves the copying skill mostly in place: the checkpoint can write the code, it rarely chooses to.
Prompt and interpreter tokens are masked from the loss. The weights are stored in float16 (the config keeps
`dtype: float32`, so they load as float32). About 1-2 minutes on 2 CPU cores.

`--code-fraction 0` builds the control whose second cold start saw no code at all; `--init-from none` starts from a
fresh model instead (with 2.5% code traces it never learns to copy: forced to start a code block, it writes a
random expression, so RL has no correct code sample to reinforce).

    python scripts/build/build_emerge_model.py [--output-dir DIR] [--code-fraction F] [--init-from DIR|none]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from retool_trl.data.synthetic import make_arithmetic_dataset, make_sft_traces
from retool_trl.models.tiny import build_char_tokenizer, build_tiny_model
from retool_trl.quickstart.arithmetic import QUICKSTART_MODEL_DIR
from retool_trl.quickstart.emerge import EMERGE_MODEL_DIR, EmergeTask, code_start_probability
from retool_trl.sft import build_sft_dataset, masked_token_stats, train_cold_start


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default=str(EMERGE_MODEL_DIR), help="Where the checkpoint is saved.")
    parser.add_argument(
        "--code-fraction",
        type=float,
        default=EmergeTask().code_fraction,
        help="Share of cold-start traces that call the interpreter (0: the no-code control).",
    )
    parser.add_argument(
        "--init-from",
        default=str(QUICKSTART_MODEL_DIR),
        help="Checkpoint to start from (default: the arithmetic quickstart's, which copies expressions and "
        "interpreter output); 'none' for a fresh tiny model (which, with so few code traces, does not learn to copy).",
    )
    parser.add_argument("--num-traces", type=int, default=4800, help="Synthetic SFT traces.")
    parser.add_argument("--max-steps", type=int, default=300, help="SFT optimizer steps.")
    parser.add_argument("--batch-size", type=int, default=16, help="Traces per step.")
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=3e-4,
        help="Peak learning rate (cosine decay). Gentle on purpose: at 1e-3 for 400 steps the direct answers' random "
        "digits wore down the copying (expression 89%%, interpreter output into \\boxed{} 82%% at T=1, against 98%% "
        "and 99.6%% at 3e-4 for 300 steps).",
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of data, initialisation and training.")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: fastest on a shared 2-core machine)."
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if not 0.0 <= args.code_fraction <= 1.0:
        raise SystemExit(f"--code-fraction must be in [0, 1], got {args.code_fraction}.")
    if args.threads:
        torch.set_num_threads(args.threads)
    task = replace(EmergeTask(), code_fraction=args.code_fraction)
    started = time.perf_counter()

    tokenizer = build_char_tokenizer()
    if args.init_from.lower() == "none":
        model = build_tiny_model(tokenizer, seed=args.seed)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
    print(f"tokenizer: {len(tokenizer)} tokens; model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params")

    traces = make_sft_traces(
        args.num_traces,
        seed=args.seed,
        difficulty=task.difficulty,
        kinds=task.kinds,
        code_fraction=task.code_fraction,
        test_fraction=task.test_fraction,
    )
    dataset = build_sft_dataset(traces, tokenizer)
    stats = masked_token_stats(dataset)
    with_code = sum(traces["uses_code"])
    print(
        f"traces: {len(dataset)} ({with_code} with code, {with_code / len(traces):.2%}), "
        f"{stats['tokens']:.0f} tokens, {stats['trained_fraction']:.0%} trained"
    )

    model, final_loss = train_cold_start(
        model, tokenizer, dataset, args.max_steps, args.batch_size, args.learning_rate, seed=args.seed
    )
    # How rare the habit is, exactly: P(first token is <code>) averaged over 256 held-out prompts.
    held_out = make_arithmetic_dataset(256, seed=args.seed, difficulty=task.difficulty, split="test")
    model.eval()
    code_start_prob = code_start_probability(model, tokenizer, list(held_out["prompt"]))
    print(f"P(first token is code) on 256 held-out prompts: {code_start_prob:.3g}")
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
        "traces_with_code": with_code,
        "num_traces": args.num_traces,
        "max_steps": args.max_steps,
        "batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
        "seed": args.seed,
        "final_loss": final_loss,
        "held_out_code_start_prob": code_start_prob,
        "build_s": round(time.perf_counter() - started, 1),
    }
    Path(args.output_dir, "build_info.json").write_text(json.dumps(build_info, indent=2) + "\n")
    print(f"saved to {args.output_dir} in {build_info['build_s']} s (final loss {final_loss:.4f})")


if __name__ == "__main__":
    main()
