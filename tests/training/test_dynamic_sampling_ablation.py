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

import render_ablation  # noqa: E402


def test_both_arms_stop_at_the_baseline_budget_of_generated_samples(tmp_path):
    """A real three-step ablation on the emergence task, whose checkpoint almost never answers right: most groups
    are all wrong, so the dynamic arm needs extra rounds and must stop after fewer steps, having generated at least
    the baseline's samples and at most two rounds more."""
    results = tmp_path / "results"
    env = {**os.environ, "RETOOL_RESULTS_DIR": str(results), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(ROOT / "scripts" / "experiments" / "ablate_dynamic_sampling.py")]
    command += ["--tasks", "emerge", "--seeds", "0", "--max-steps", "3", "--output-dir", str(tmp_path / "runs")]
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

    # A short try-out (`--max-steps`) never reaches the docs' table; the same line at the full budget does.
    assert render_ablation.chosen(results) == {}
    del line["max_steps"]
    (results / "dynamic_sampling_ablation.jsonl").write_text(json.dumps(line) + "\n")
    rendered = render_ablation.blocks(results)[render_ablation.BENCHMARK]
    row = next(r for r in rendered.splitlines() if r.startswith("| emerge | dynamic | steps trained |"))
    assert row.endswith(f"| {dynamic['steps']} |"), row
    assert render_ablation.draw(results).is_file()
