#!/usr/bin/env bash
# GPU check of the vLLM rollout (one short run, ~5 min on one GPU; the GPU box has no model hub):
# installs the vllm extra, builds a small random Qwen2 + tokenizer locally, runs a few ReToolTrainer steps with vLLM
# colocate and LoRA, and prints interleaved-rollout tokens/s vs vLLM plain generate of the same token count.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -e ".[vllm]"
python scripts/gpu_smoke.py "$@"
