"""The GPU check (`scripts/gpu/gpu_check.py`) on a CPU: it is run blind on a GPU machine without network access, with a
few minutes of device time, so whatever can break before CUDA matters must break here first."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "gpu"))


def test_qwen_shaped_tokenizer_keeps_qwen_ids_and_format():
    """The check's stand-in for Qwen2.5's tokenizer: Qwen2.5's special-token ids and added-token count, the ReTool
    tags as single tokens, exact round trips, and Qwen2.5's chat template (a real model's prompt format)."""
    from gpu_check import SHAPES
    from gpu_model import build_tokenizer

    bpe = 2_048
    tokenizer = build_tokenizer(bpe)
    assert len(tokenizer) == bpe + 22  # Qwen2.5: 151,643 BPE tokens + 22 added = 151,665
    assert SHAPES["qwen2.5-1.5b"]["bpe_tokens"] + 22 == 151_665 <= SHAPES["qwen2.5-1.5b"]["vocab_size"]
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [bpe, bpe + 1, bpe + 2]  # 151643, 151644, 151645 at full size
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    for tag in ("<code>", "</code>", "<interpreter>", "</interpreter>"):
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1
    text = "Héllo 数学 <code>print(6 * 7)</code>\n<interpreter>42\n</interpreter> so \\boxed{42}"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow
def test_cpu_run_emits_the_json_line(tmp_path):
    """`gpu_check.py --device cpu --shape tiny`: real trainer steps with the real sandbox and the throughput
    comparison; the last stdout line is the JSON object, the same as the file `--out` writes."""
    out = tmp_path / "check.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [sys.executable, "scripts/gpu/gpu_check.py", "--device", "cpu", "--skip", "mask_gradient,kv_reuse"]
        + ["--steps", "1", "--repeats", "1", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == result
    assert result["errors"] == {} and result["ok"] is True
    train = result["train"]
    assert train["steps"] == 1 and train["loss_finite"] and train["retool_metrics_present"]
    assert train["retool_metrics"]["retool/calls_per_completion"] == 2.0  # both forced cells ran in the sandbox
    assert train["retool_metrics"]["retool/error_rate"] == 0.0
    assert len(train["rollout_s"]) == len(train["sandbox_s"]) == 1
    tool_call = result["tool_call"]  # a tool call in Qwen2.5's format, read, run and answered, on the same model
    assert tool_call["calls_read"] and tool_call["retool_metrics"]["retool/calls_per_completion"] == 1.0
    throughput = result["throughput"]
    assert throughput["plain_tokens"] == throughput["rollout_tokens"]  # the same number of tokens per row
    assert throughput["rollout_tokens_per_s"] > 0 and throughput["plain_generate_tokens_per_s"] > 0
