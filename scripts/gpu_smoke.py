"""GPU smoke test of ReToolTrainer with vLLM colocate + LoRA on a locally built random Qwen2 (no hub needed).

Prints the interleaved rollout's tokens/s next to vLLM's plain generate of the same number of tokens, and the
`retool/*` metrics of a few training steps. Run through `scripts/gpu_smoke.sh`.
"""

import json
import os
import tempfile
import time

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch
from datasets import Dataset
from peft import LoraConfig

from retool_trl import ReToolConfig, ReToolTrainer
from retool_trl.tiny import build_char_tokenizer, build_tiny_model


def main():
    tmp = tempfile.mkdtemp(prefix="gpu_smoke_")
    # Byte-level tokenizer: vLLM reloads it with AutoTokenizer, and this one survives that unchanged.
    tokenizer = build_char_tokenizer(model_max_length=1024)
    model = build_tiny_model(
        tokenizer, hidden_size=512, num_layers=8, num_heads=8, intermediate_size=1536, max_position_embeddings=1024
    )
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    prompts = [f"Compute {i} * 7 with <code>print({i} * 7)</code>:" for i in range(64)]
    dataset = Dataset.from_list([{"prompt": p, "answer": str(i * 7)} for i, p in enumerate(prompts)])
    args = ReToolConfig(
        output_dir=f"{tmp}/out",
        per_device_train_batch_size=32,
        num_generations=8,
        max_completion_length=256,
        max_steps=3,
        logging_steps=1,
        report_to="none",
        bf16=True,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,
        vllm_max_model_length=1024,
        learning_rate=1e-4,
        save_strategy="no",
    )
    trainer = ReToolTrainer(
        tmp,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    )
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start

    batch = prompts[:32]
    start = time.perf_counter()
    _, completion_ids, tool_mask, *_ = trainer._generate(batch)
    rollout_s = time.perf_counter() - start
    tokens = sum(len(c) for c in completion_ids)
    # vLLM plain generate of the same number of tokens: one call, no stop string, fixed length.
    helper = trainer.vllm_generation
    saved = helper.max_completion_length, helper.generation_kwargs
    helper.max_completion_length = max(1, tokens // len(batch))
    helper.generation_kwargs = {**(saved[1] or {}), "ignore_eos": True}
    ids = [tokenizer(p)["input_ids"] for p in batch]
    start = time.perf_counter()
    _, plain_ids, _, _ = helper.generate(prompts=ids, images=None, num_generations=1)
    plain_s = time.perf_counter() - start
    helper.max_completion_length, helper.generation_kwargs = saved
    plain_tokens = sum(len(c) for c in plain_ids)
    logs = [e for e in trainer.state.log_history if "retool/code_ratio" in e]
    print(
        json.dumps(
            {
                "gpu": torch.cuda.get_device_name(0),
                "train_3_steps_s": round(train_s, 2),
                "rollout_tokens_per_s": round(tokens / rollout_s, 1),
                "plain_generate_tokens_per_s": round(plain_tokens / plain_s, 1),
                "rollout_vs_plain_time_per_token": round((rollout_s / tokens) / (plain_s / plain_tokens), 3),
                "interpreter_token_fraction": round(1 - sum(map(sum, tool_mask)) / max(tokens, 1), 3),
                "last_retool_metrics": {
                    k: v for k, v in (logs[-1] if logs else {}).items() if k.startswith("retool/")
                },
            }
        )
    )


if __name__ == "__main__":
    main()
