"""The emergence quickstart: a shipped checkpoint that rarely calls code, and RL with and without the interpreter.

The end-to-end test is the short version of `retool-trl quickstart --task emerge` that CI runs; the figures it is
judged by (five seeds, 100 steps) are in docs/quickstart.md, rendered from scripts/results/quickstart_emerge.jsonl.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from retool_trl.data.synthetic import make_arithmetic_dataset
from retool_trl.quickstart import EmergeTask, emerge_model_path, run_quickstart
from retool_trl.quickstart.emerge import passed_half, step_curves

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_model_is_tiny_and_rarely_calls_code():
    """A user's first look at the checkpoint: small enough to ship, cold-started on few code traces, and at T=1 it
    starts an answer with code only now and then (the issue's bar is <= 5% on 256 held-out problems; the docs give
    the measured figure)."""
    path = Path(emerge_model_path())
    assert sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) < 2 * 2**20
    info = json.loads((path / "build_info.json").read_text())
    assert info["task"]["code_fraction"] == EmergeTask().code_fraction <= 0.05
    assert 0 < info["traces_with_code"] <= 0.05 * info["num_traces"]
    assert 0 < info["held_out_code_start_prob"] <= 0.05  # the exact habit the docs quote, as the build measures it
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.dtype == torch.float32  # stored in float16, loaded (and trained) in float32
    problems = make_arithmetic_dataset(256, seed=3, difficulty=EmergeTask().difficulty, split="test")
    batch = tokenizer(list(problems["prompt"]), return_tensors="pt", padding=True)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=7, do_sample=True, temperature=1.0)
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    code = sum(t.startswith("<code>") for t in texts)
    assert code <= 0.08 * len(texts), code  # 5% plus two standard errors of the sample
    assert sum(t.startswith("\\boxed{") for t in texts) >= 0.85 * len(texts)  # the rest answer directly


def test_step_curves_and_the_step_code_use_passed_half():
    """The ZeroTIR curve from TRL's log history: one point per logged step (evaluation entries have no code ratio),
    and the first step at which code use reached 50%."""
    history = [
        {"step": 1, "retool/code_ratio": 0.03, "retool/accuracy": 0.04},
        {"step": 2, "retool/code_ratio": 0.2, "rewards/boxed_accuracy/mean": 0.0},
        {"step": 2, "train_runtime": 9.0},
        {"step": 3, "retool/code_ratio": 0.5, "retool/accuracy": 0.5},
        {"step": 4, "retool/code_ratio": 0.4, "retool/accuracy": 0.4},
    ]
    curves = step_curves(history)
    assert curves == {"step_code_ratio": [0.03, 0.2, 0.5, 0.4], "step_accuracy": [0.04, 0.5, 0.5, 0.4]}
    assert passed_half(curves["step_code_ratio"]) == 3
    assert passed_half([0.0, 0.49]) is None


def test_emerge_quickstart_end_to_end(tmp_path):
    """The short CI version of `retool-trl quickstart --task emerge`: the run folder a user gets, with the other
    tasks' summary shape plus the per-step curves and the step code use passed 50%."""
    summary = run_quickstart(
        tmp_path / "run", task="emerge", max_steps=2, prompts_per_step=2, num_generations=4, num_train=8, num_eval=8
    )
    out = tmp_path / "run"
    written = json.loads((out / "summary.json").read_text())
    assert written == json.loads(json.dumps(summary))
    assert written["settings"]["task"] == "emerge" and written["model"] == emerge_model_path()
    assert written["settings"]["lr_decay_steps"] == 60  # the task's default, not the arithmetic one
    for run in ("tool_rl", "text_rl"):
        r = written[run]
        for key in ("accuracy_before", "accuracy_after", "code_ratio_before", "code_ratio_after"):
            assert 0 <= r[key] <= 1
        assert len(r["step_code_ratio"]) == len(r["step_accuracy"]) == r["steps"] == 2
        logged = [json.loads(line) for line in (out / run / "log.jsonl").read_text().splitlines()]
        assert r["step_code_ratio"] == [e["retool/code_ratio"] for e in logged if "retool/code_ratio" in e]
        assert r["step_code_ratio_passed_50"] == passed_half(r["step_code_ratio"])
    assert written["text_rl"]["code_ratio_after"] == 0
    assert (out / "quickstart.png").stat().st_size > 10_000


def test_cli_lists_the_emerge_task(capsys):
    """`retool-trl quickstart --help` names the task and its own defaults."""
    from retool_trl.cli import main

    assert main(["quickstart", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "'emerge'" in text and "emerge: 120" in text


def _line(seed, label, accuracy_after, max_steps=100):
    curve = [0.03, 0.6, 0.97]
    run = {
        "accuracy_before": 0.02,
        "accuracy_after": accuracy_after,
        "code_ratio_before": 0.03,
        "code_ratio_after": 0.99,
        "step_code_ratio": curve,
        "step_accuracy": curve,
        "step_code_ratio_passed_50": 2,
    }
    return {
        "label": label,
        "seed": seed,
        "tool_rl": run,
        "text_rl": {**run, "accuracy_after": 0.0, "code_ratio_after": 0.0},
        "wall_s": 400.0,
        "settings": {"max_steps": max_steps},
        "run": {"date": "2026-01-01T00:00:00Z", "commit": "abc", "cpu_count": 2, "load_avg_before": [0.1]},
    }


def test_the_docs_table_uses_the_newest_recipe_per_seed(tmp_path):
    """Seeds measured with an older recipe never mix into the table of the newest one, and each seed shows its
    newest line."""
    sys.path.insert(0, str(ROOT / "scripts" / "render"))
    import render_quickstart

    lines = [
        _line(0, "shipped", 0.50, max_steps=60),
        _line(0, "shipped", 0.91),
        _line(1, "shipped", 0.70, max_steps=60),
        _line(0, "shipped", 0.95),
        _line(0, "no_code", 0.0),
    ]
    (tmp_path / "quickstart_emerge.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    rendered = render_quickstart.blocks(tmp_path)
    table = rendered["quickstart_emerge"]
    row = next(r for r in table.splitlines() if r.startswith("| tool_rl | held-out accuracy after"))
    assert row == "| tool_rl | held-out accuracy after | 95.0% | 95.0% | 95.0% | 95.0% |"
    assert "seed 1" not in table and "line 4 (seed 0)" in table
    assert "no_code" not in table and "quickstart_emerge_no_code" in rendered
    assert render_quickstart.draw(tmp_path).stat().st_size > 10_000
