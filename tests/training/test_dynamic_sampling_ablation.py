"""The dynamic-sampling ablation in docs/training.md compares like with like.

Stands for a reader who reruns `scripts/experiments/ablate_dynamic_sampling.py`: both arms must stop at the same
budget of generated samples (a dynamic step that took three rollout rounds spends three steps' worth), and the docs'
table must come from the full-budget lines only, not from a short try-out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "render"))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))  # results_log
sys.path.insert(0, str(ROOT / "scripts" / "experiments"))

import ablate_dynamic_sampling  # noqa: E402
import pytest  # noqa: E402
import render_ablation  # noqa: E402
from transformers import TrainerControl, TrainerState  # noqa: E402

from retool_trl.config import ReToolConfig  # noqa: E402


def _step(callback, config, state, logs):
    """What the Trainer does at each log: append the entry, then call `on_log` with the same logs."""
    state.log_history.append({**logs, "step": len(state.log_history) + 1})
    control = TrainerControl()
    callback.on_log(config, state, control, logs=logs)
    return control


def test_the_budget_counts_every_round_and_stops_at_the_budget(tmp_path):
    """The budget's arithmetic, on the logs the Trainer hands it: rounds x generation batch per step, the
    end-of-training summary not counted, the stop on the step that reaches the budget and not before."""
    config = ReToolConfig(str(tmp_path), dynamic_sampling=True, logging_steps=1, per_device_train_batch_size=8)
    callback = ablate_dynamic_sampling.budget_callback(budget=5 * 64, generation_batch=64)
    callback.on_train_begin(config, TrainerState(), TrainerControl())
    state = TrainerState()
    assert not _step(
        callback, config, state, {"reward": 0.1, ablate_dynamic_sampling.ROUNDS: 3.0}
    ).should_training_stop
    assert state.log_history[-1]["retool/samples_generated"] == 3 * 64
    assert not _step(
        callback, config, state, {"reward": 0.2, ablate_dynamic_sampling.ROUNDS: 1.0}
    ).should_training_stop
    callback.on_log(config, state, TrainerControl(), logs={"train_runtime": 1.0})  # the summary: not a step
    assert _step(callback, config, state, {"reward": 0.3, ablate_dynamic_sampling.ROUNDS: 2.0}).should_training_stop
    assert callback.generated == 6 * 64
    with pytest.raises(RuntimeError, match="logged no"):  # a step that did not say how many rounds it took
        _step(callback, config, state, {"reward": 0.3})


def test_the_budget_refuses_settings_where_a_step_is_not_one_generation_batch(tmp_path):
    """With several logged steps per log, or one generation batch over several steps, counting per log is wrong."""
    callback = ablate_dynamic_sampling.budget_callback(budget=64, generation_batch=64)
    for fields in ({"logging_steps": 5}, {"steps_per_generation": 2}):
        config = ReToolConfig(str(tmp_path), per_device_train_batch_size=8, **fields)
        with pytest.raises(ValueError, match="logging_steps=1"):
            callback.on_train_begin(config, TrainerState(), TrainerControl())


def test_both_arms_stop_at_the_baseline_budget_of_generated_samples(tmp_path):
    """A real three-step ablation on the emergence task, whose checkpoint almost never answers right: most groups
    are all wrong, so the dynamic arm needs extra rounds and must stop after fewer steps, having generated at least
    the baseline's samples and at most two rounds more."""
    results = tmp_path / "results"
    env = {**os.environ, "RETOOL_RESULTS_DIR": str(results), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "scripts" / "experiments" / "ablate_dynamic_sampling.py")]
    command += ["--tasks", "emerge", "--seeds", "0", "--max-steps", "3", "--num-eval", "16"]
    command += ["--output-dir", str(tmp_path / "runs")]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [json.loads(text) for text in (results / "dynamic_sampling_ablation.jsonl").read_text().splitlines()]
    batch = 8 * 8  # the emergence task's problems per step x samples per problem
    budget = 3 * batch
    baseline, dynamic = line["arms"]["baseline"], line["arms"]["dynamic"]
    assert baseline["budget"] == dynamic["budget"] == budget
    assert baseline["steps"] == 3 and baseline["samples"] == budget
    assert sum(dynamic["step_rounds"]) > dynamic["steps"], "no step needed a second round: nothing was dropped"
    assert dynamic["samples"] == round(sum(dynamic["step_rounds"])) * batch
    assert budget <= dynamic["samples"] <= budget + 2 * batch
    assert dynamic["steps"] < baseline["steps"]
    for arm in (baseline, dynamic):
        assert 0.0 <= arm["accuracy_after"] <= 1.0 and len(arm["step_code_ratio"]) == arm["steps"]

    # A short try-out (`--max-steps`, `--num-eval`) never reaches the docs' table; the same line at full size does.
    assert render_ablation.chosen(results) == {}
    del line["max_steps"], line["num_eval"]
    (results / "dynamic_sampling_ablation.jsonl").write_text(json.dumps(line) + "\n")
    rendered = render_ablation.blocks(results)[render_ablation.BENCHMARK]
    row = next(r for r in rendered.splitlines() if r.startswith("| emerge | dynamic | steps trained |"))
    assert row.endswith(f"| {dynamic['steps']} |"), row
    assert render_ablation.draw(results).is_file()
