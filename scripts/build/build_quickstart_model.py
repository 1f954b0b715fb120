"""Builds the quickstart checkpoints shipped in `retool_trl/assets/`, one per call format.

A tiny randomly initialised Qwen2, cold-started with `retool_trl.sft` on synthetic arithmetic traces (70% call the
interpreter, 30% answer directly; prompt and interpreter tokens masked from the loss), the traces written in the
model's call format (`CallFormat.sft_trace`):

- `tags` (`quickstart_model/`): character-level tokenizer, `<code>...</code>` answered by `<interpreter>`;
- `markdown` (`markdown_model/`): the same character-level tokenizer, with the fences (```` ```python ````,
  ```` ```output ````, the closing ```` ``` ````) as single tokens in place of the tags;
- `tool_call` (`tool_call_model/`): a chat model: TRL's Qwen2.5 chat template (`<|im_start|>` roles, the
  `code_interpreter` schema in the system turn, `<tool_call>` JSON calls answered in `<tool_response>`) over a small
  byte-level BPE vocabulary trained on the rendered traces (`retool_trl.models.tiny.build_chat_tokenizer`).

The model records its format (`retool_prompt.json`), so `retool-trl eval` and `train` of it use that format. Takes a
few minutes on 2 CPU cores:

    python scripts/build/build_quickstart_model.py [--call-format tags|markdown|tool_call] [--output-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict

import torch

from retool_trl.data.synthetic import make_sft_traces
from retool_trl.models.tiny import build_tiny_model
from retool_trl.quickstart import QuickstartTask
from retool_trl.quickstart.arithmetic import FORMAT_MODEL_DIRS, format_tokenizer, record_format
from retool_trl.sft import build_sft_dataset, masked_token_stats, train_cold_start


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--call-format", default="tags", choices=sorted(FORMAT_MODEL_DIRS), help="Format the traces are written in."
    )
    parser.add_argument(
        "--output-dir", default=None, help="Where the checkpoint is saved (default: its assets folder)."
    )
    parser.add_argument("--num-traces", type=int, default=32000, help="Synthetic SFT traces.")
    parser.add_argument("--max-steps", type=int, default=2000, help="SFT optimizer steps.")
    parser.add_argument("--batch-size", type=int, default=16, help="Traces per step.")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="Peak learning rate (cosine decay).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of data, initialisation and training.")
    parser.add_argument(
        "--init-from",
        default=None,
        help="Continue the cold start of this checkpoint (its model and tokenizer) instead of a new model; use "
        "another --seed than its build for new traces.",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice).")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    task = QuickstartTask()
    started = time.perf_counter()
    output_dir = args.output_dir or str(FORMAT_MODEL_DIRS[args.call_format])

    traces = make_sft_traces(
        args.num_traces,
        seed=args.seed,
        difficulty=task.sft_difficulties,
        kinds=task.kinds,
        code_fraction=task.code_fraction,
        test_fraction=task.test_fraction,
    )
    earlier = None
    if args.init_from:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.init_from)
        model = AutoModelForCausalLM.from_pretrained(args.init_from)
        with open(f"{args.init_from}/build_info.json") as f:
            earlier = json.load(f)
    else:
        tokenizer = format_tokenizer(args.call_format, traces)
        model = build_tiny_model(tokenizer, seed=args.seed)
    print(f"tokenizer: {len(tokenizer)} tokens; model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params")
    dataset = build_sft_dataset(traces, tokenizer, call_format=args.call_format)
    stats = masked_token_stats(dataset)
    print(
        f"traces: {len(dataset)} ({sum(traces['uses_code']) / len(traces):.0%} with code), "
        f"{stats['tokens']:.0f} tokens, {stats['trained_fraction']:.0%} trained"
    )

    model, final_loss = train_cold_start(
        model, tokenizer, dataset, args.max_steps, args.batch_size, args.learning_rate, seed=args.seed
    )
    shutil.rmtree(output_dir, ignore_errors=True)
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    record_format(output_dir, args.call_format)
    build_info = {
        "call_format": args.call_format,
        "task": asdict(task),
        "num_traces": args.num_traces,
        "max_steps": args.max_steps,
        "batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
        "seed": args.seed,
        "final_loss": final_loss,
        "build_s": round(time.perf_counter() - started, 1),
    }
    if earlier is not None:  # the stages so far, oldest first
        build_info["continued_from"] = [*earlier.pop("continued_from", []), earlier]
    with open(f"{output_dir}/build_info.json", "w") as f:
        json.dump(build_info, f, indent=2)
    print(f"saved to {output_dir} in {build_info['build_s']} s (final loss {final_loss:.4f})")


if __name__ == "__main__":
    main()
